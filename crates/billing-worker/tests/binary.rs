//! The `billing-worker` binary as shipped (see `testkit::cli`).

testkit::binary_tests!(worker "billing-worker", ["DEMO_FAULTS", "DEMO_CATALOGUE"]);
