//! Checks of a service binary as shipped, made by [`binary_tests!`](crate::binary_tests) in each
//! service crate's `tests/binary.rs`. Having such a test is also what makes `cargo test` build the
//! binary the process tests start.

use std::process::Command;

/// The settings every worker built on `messaging::service::Worker` takes.
pub const WORKER_VARIABLES: &[&str] = &[
    "DATABASE_URL",
    "AMQP_URL",
    "HTTP_ADDR",
    "RETRY_DELAYS",
    "MAX_ATTEMPTS",
    "PREFETCH",
    "MAX_CRASHES",
    "HANDLER_TIMEOUT",
    "CONFIRM_TIMEOUT",
    "DELIVERY_LIMIT",
    "INBOX_RETENTION",
    "IDLE_RENEWAL",
];

/// `--help` names every environment variable in `variables`.
pub fn assert_help_names(binary: &str, variables: &[&str]) {
    let output = Command::new(binary).arg("--help").output().expect("run --help");
    assert!(output.status.success(), "{output:?}");
    let help = String::from_utf8_lossy(&output.stdout);
    for variable in variables {
        assert!(help.contains(&format!("env: {variable}")), "--help does not name {variable}:\n{help}");
    }
}

/// An `INBOX_RETENTION` shorter than the retry horizon stops the binary at once, naming both values.
/// (With the orders API's one required setting, `AUTH_JWT_KEY`, given: other binaries ignore it.)
pub fn assert_short_inbox_retention_refused(binary: &str) {
    let output =
        Command::new(binary).env("AUTH_JWT_KEY", crate::auth::KEY).env("INBOX_RETENTION", "1h").output().expect("run");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(error.contains("INBOX_RETENTION=1h is shorter than the 1d 2m 36s"), "{error}");
}

/// A bad setting stops the binary at once, before it touches a server: exit 2, naming the flag.
pub fn assert_bad_setting_refused(binary: &str) {
    let output = Command::new(binary)
        .env("AUTH_JWT_KEY", crate::auth::KEY)
        .env("HTTP_ADDR", "not-an-address")
        .output()
        .expect("run");
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(error.contains("invalid value 'not-an-address' for '--http-addr"), "{error}");
}

/// The checks of a service binary as shipped, as two tests: `--help` names each environment
/// variable listed (with `worker`, also every worker's [`WORKER_VARIABLES`]), and a bad setting is
/// refused before connecting.
///
/// ```ignore
/// testkit::binary_tests!(worker "inventory-worker", ["DEMO_FAULTS"]);
/// testkit::binary_tests!("relay", ["DATABASE_URL", "AMQP_URL", "RELAY_BATCH_SIZE"]);
/// ```
#[macro_export]
macro_rules! binary_tests {
    (worker $binary:literal, [$($variable:literal),* $(,)?]) => {
        $crate::binary_tests!(@tests $binary, [$crate::cli::WORKER_VARIABLES, &[$($variable),*]].concat());

        #[test]
        fn an_inbox_retention_shorter_than_the_retries_is_refused() {
            $crate::cli::assert_short_inbox_retention_refused(env!(concat!("CARGO_BIN_EXE_", $binary)));
        }
    };
    ($binary:literal, [$($variable:literal),* $(,)?]) => {
        $crate::binary_tests!(@tests $binary, [$($variable),*]);
    };
    (@tests $binary:literal, $variables:expr) => {
        #[test]
        fn help_names_every_setting() {
            $crate::cli::assert_help_names(env!(concat!("CARGO_BIN_EXE_", $binary)), &$variables);
        }

        #[test]
        fn bad_setting_is_refused_before_connecting() {
            $crate::cli::assert_bad_setting_refused(env!(concat!("CARGO_BIN_EXE_", $binary)));
        }
    };
}
