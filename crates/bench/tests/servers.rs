//! The bench measures the servers it is told to. Without `DATABASE_URL` or `AMQP_URL` it refuses to
//! start (exit 2), where the test kit would start containers of its own and the run would measure
//! them instead.

use std::process::Command;

#[test]
fn refuses_to_start_unless_both_servers_are_named() {
    for (named, unnamed) in [("AMQP_URL", "DATABASE_URL"), ("DATABASE_URL", "AMQP_URL")] {
        let output = Command::new(env!("CARGO_BIN_EXE_bench"))
            .env_remove("DATABASE_URL")
            .env_remove("AMQP_URL")
            .env_remove("TEST_DATABASE_URL")
            .env_remove("TEST_AMQP_URL")
            .env(named, "unused://127.0.0.1:1")
            .output()
            .expect("run the bench");
        assert_eq!(output.status.code(), Some(2), "without {unnamed}: {output:?}");
    }
}
