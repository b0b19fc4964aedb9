//! The `billing-worker` binary as shipped (see `testkit::cli`).

const BINARY: &str = env!("CARGO_BIN_EXE_billing-worker");

#[test]
fn help_names_every_setting() {
    testkit::cli::assert_help_names(
        BINARY,
        &["DATABASE_URL", "AMQP_URL", "HTTP_ADDR", "RETRY_DELAYS", "MAX_ATTEMPTS", "PREFETCH", "DEMO_FAULTS"],
    );
}

#[test]
fn bad_setting_is_refused_before_connecting() {
    testkit::cli::assert_bad_setting_refused(BINARY);
}
