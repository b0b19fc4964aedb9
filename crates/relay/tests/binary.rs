//! The `relay` binary as shipped (see `testkit::cli`).

testkit::binary_tests!(
    "relay",
    [
        "DATABASE_URL",
        "AMQP_URL",
        "HTTP_ADDR",
        "RELAY_BATCH_SIZE",
        "RELAY_POLL_INTERVAL",
        "RELAY_RETRY_INITIAL",
        "RELAY_RETRY_MAX",
        "RELAY_MAX_ATTEMPTS",
        "CONFIRM_TIMEOUT",
        "OUTBOX_RETENTION",
    ]
);
