//! A default build of the services carries none of the test machinery (decision 0025): with
//! `FAILPOINTS` armed at every point and `DEMO_FAULTS` on, it runs orders of the demo's fault SKUs
//! like any other, and reports `build_info{failpoints="off"}`. A test build would freeze at the
//! first commit and crash on `CRASH-1`.
//!
//! It needs the services built without features, which a workspace build cannot make (the test
//! kit turns the features on for every binary it builds), in a target directory of their own:
//!
//! ```sh
//! CARGO_TARGET_DIR=target/default-build cargo build -p orders-api -p relay -p inventory-worker -p billing-worker
//! SHOP_BIN_DIR=target/default-build/debug cargo test -p testkit --test default_build -- --ignored
//! ```
//!
//! CI does this. Without `SHOP_BIN_DIR` the test fails: it was asked for.

use std::time::Duration;

use messaging::runtime::failpoint;
use testkit::{
    services::Service,
    shop::{Options, Shop},
};

#[tokio::test]
#[ignore = "needs the services built without features in SHOP_BIN_DIR; CI builds them and runs it with --ignored"]
async fn a_default_build_ignores_failpoints_and_demo_faults() {
    assert!(std::env::var_os("SHOP_BIN_DIR").is_some(), "SHOP_BIN_DIR names the default build's binaries");
    let armed = [failpoint::WORKER_BEFORE_COMMIT, failpoint::WORKER_AFTER_COMMIT].join(",");
    let mut shop = Shop::start(Options {
        demo_faults: true,
        consumer_env: vec![("FAILPOINTS", armed)],
        relay_env: vec![("FAILPOINTS", failpoint::RELAY_AFTER_CONFIRM.to_owned())],
        // Each attempt a fault would cost is spent at once.
        retry_delays: "100ms".into(),
        max_attempts: 3,
        test_build: false,
        ..Options::default()
    })
    .await;
    let mut jobs = Vec::new();
    for sku in ["SKU-1", "FLAKY-1", "POISON-1", "CRASH-1"] {
        jobs.push((sku, shop.place(&[(sku, 1)]).await));
    }
    for (sku, job_id) in jobs {
        let job = shop.wait_for_state(job_id, "succeeded").await;
        assert!(job["attempt"].as_i64().is_some_and(|attempt| attempt <= 1), "{sku} took one attempt: {job}");
    }
    shop.assert_all_running();
    for service in Service::ALL {
        for point in [failpoint::WORKER_BEFORE_COMMIT, failpoint::WORKER_AFTER_COMMIT, failpoint::RELAY_AFTER_CONFIRM] {
            assert_eq!(shop.process(service).failpoint_hits(point), 0, "{service:?} reached {point}");
        }
    }
    let retried = r#"messages_handled_total{endpoint="inventory.order-placed",outcome="retried""#;
    assert_eq!(shop.metric(Service::Inventory, retried).await, 0, "no demo fault made inventory retry");
    shop.assert_books_balance().await;
    tokio::time::timeout(Duration::from_secs(30), shop.stop()).await.expect("the shop stops");
}
