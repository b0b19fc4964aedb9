//! The `relay` binary as shipped (see `testkit::cli`).

const BINARY: &str = env!("CARGO_BIN_EXE_relay");

#[test]
fn help_names_every_setting() {
    testkit::cli::assert_help_names(
        BINARY,
        &[
            "DATABASE_URL",
            "AMQP_URL",
            "HTTP_ADDR",
            "RELAY_BATCH_SIZE",
            "RELAY_POLL_INTERVAL",
            "RELAY_RETRY_INITIAL",
            "RELAY_RETRY_MAX",
            "OUTBOX_RETENTION",
        ],
    );
}

#[test]
fn bad_setting_is_refused_before_connecting() {
    testkit::cli::assert_bad_setting_refused(BINARY);
}
