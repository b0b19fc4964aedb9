//! The `orders-api` binary as shipped (see `testkit::cli`).

testkit::binary_tests!(worker "orders-api", ["DATABASE_POOL_SIZE", "SHOP_METRICS_URLS", "RABBITMQ_MANAGEMENT_URL", "MAX_MESSAGE_BYTES"]);
