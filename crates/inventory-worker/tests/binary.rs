//! The `inventory-worker` binary as shipped (see `testkit::cli`).

testkit::binary_tests!(worker "inventory-worker", ["DEMO_FAULTS", "DEMO_CATALOGUE"]);
