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
        "BOOKS_GRACE"
    ]
);
