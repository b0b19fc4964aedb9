//! The `orders-api` binary as shipped (see `testkit::cli`).

testkit::binary_tests!(
    worker "orders-api",
    [
        "DATABASE_POOL_SIZE",
        "SHOP_METRICS_URLS",
        "RABBITMQ_MANAGEMENT_URL",
        "MAX_MESSAGE_BYTES",
        "ORDER_DEADLINE",
        "BOOKS_CHECK",
        "BOOKS_INVENTORY_URL",
        "BOOKS_BILLING_URL",
        "BOOKS_INTERVAL",
        "BOOKS_GRACE",
        "AUTH_JWT_KEY",
        "AUTH_JWT_ALGORITHM",
        "AUTH_JWT_ISSUER",
        "AUTH_JWT_AUDIENCE",
        "CONSOLE_AMQP_URL",
        "TRACE_VIEW_URL"
    ]
);

/// There is no way to take orders unauthenticated: without a key, or with one too short to be an
/// HS256 secret, the binary stops at once (exit 2), naming the setting, before it touches a server.
#[test]
fn a_missing_or_weak_token_key_is_refused_at_start_up() {
    let run = |key: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_orders-api"));
        command.env_remove("AUTH_JWT_KEY").env("DATABASE_URL", "postgres://127.0.0.1:1/orders");
        if let Some(key) = key {
            command.env("AUTH_JWT_KEY", key);
        }
        let output = command.output().expect("run orders-api");
        assert_eq!(output.status.code(), Some(2), "{output:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    assert!(run(None).contains("--auth-jwt-key <AUTH_JWT_KEY>"));
    assert!(run(Some("secret")).contains("AUTH_JWT_KEY: an HS256 secret must be 32 bytes at least"));
}
