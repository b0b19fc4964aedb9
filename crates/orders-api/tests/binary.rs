//! The `orders-api` binary as shipped (see `testkit::cli`).

const BINARY: &str = env!("CARGO_BIN_EXE_orders-api");

#[test]
fn help_names_every_setting() {
    testkit::cli::assert_help_names(
        BINARY,
        &["DATABASE_URL", "AMQP_URL", "HTTP_ADDR", "DATABASE_POOL_SIZE", "RETRY_DELAYS", "MAX_ATTEMPTS", "PREFETCH"],
    );
}

#[test]
fn bad_setting_is_refused_before_connecting() {
    testkit::cli::assert_bad_setting_refused(BINARY);
}
