//! Crash loops and returns of unacked deliveries, with the real binaries (decision 0005):
//! - a message that kills its worker every time ends quarantined by the runtime's crash bound,
//!   and nothing prefetched beside it is parked, quarantined or stuck;
//! - deliveries handed back unhandled (connection cuts during a database outage) spend nothing
//!   and move no message towards parking;
//! - what the broker dead-letters by its own delivery limit still ends its job, quarantined;
//! - a delivery the broker counts as handed over but the consumer never saw (a quorum queue's
//!   leader change can leave one) comes back once the idle consumer renews its channels.

use std::time::Duration;

use messaging::runtime::metrics::{CONSUMER_SESSIONS, DELIVERIES_HELD};
use testkit::{
    eventually,
    shop::{Options, Service, Shop, WAIT},
};
use uuid::Uuid;

/// The parking and dead-letter intake queues of every endpoint, with their depths.
async fn parked(shop: &Shop) -> Vec<(String, Option<u32>)> {
    let mut depths = Vec::new();
    for endpoint in ["inventory.order-placed", "billing.inventory-reserved", "orders.status"] {
        for queue in [format!("{endpoint}.parking"), format!("{endpoint}.dead-lettered")] {
            let depth = shop.env.queue_depth(&queue).await;
            depths.push((queue, depth));
        }
    }
    depths
}

/// Wait until the inventory worker holds a delivery for its unreachable database, in a session
/// that started after `sessions` had started.
async fn wait_until_held(shop: &Shop, sessions: u64) {
    eventually("the inventory worker to hold a delivery in a new session", WAIT, || async {
        let started = shop.metric(Service::Inventory, CONSUMER_SESSIONS).await > sessions;
        (started && shop.metric(Service::Inventory, DELIVERIES_HELD).await >= 1).then_some(())
    })
    .await;
}

/// Close the inventory worker's broker connection (every delivery it holds goes back, unacked),
/// and let it connect again.
async fn cut_broker_connection(shop: &Shop) {
    let proxy = shop.broker_proxy(Service::Inventory);
    proxy.cut();
    eventually("the worker's broker connection closed", WAIT, || async {
        (proxy.open_connections() == 0).then_some(())
    })
    .await;
    proxy.restore();
}

/// Cut the inventory worker's broker connection while it holds a delivery, and wait until it has
/// reconnected and holds one again: one return of an unacked, unhandled delivery.
async fn return_held_delivery(shop: &Shop) {
    let sessions = shop.metric(Service::Inventory, CONSUMER_SESSIONS).await;
    cut_broker_connection(shop).await;
    wait_until_held(shop, sessions).await;
}

#[tokio::test]
async fn three_crashing_orders_among_200_are_quarantined_and_no_other_message_is_parked_or_stuck() {
    let options = Options { prefetch: 16, demo_faults: true, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let mut crashing = Vec::new();
    for i in 0..200 {
        if i % 60 == 30 {
            crashing.push(shop.place(&[("CRASH-1", 1)]).await);
        } else {
            shop.place(&[("SKU-1", 1), ("SKU-2", 1 + i % 2)]).await;
        }
    }
    assert_eq!(crashing.len(), 3);

    // A supervisor's part: restart the worker whenever it exits, until every job has ended.
    let mut restarts = 0;
    let deadline = tokio::time::Instant::now() + WAIT * 3;
    let ledger = loop {
        restarts += shop.restart_exited().await;
        let ledger = shop.ledger().await;
        if ledger.is_settled() {
            break ledger;
        }
        assert!(tokio::time::Instant::now() < deadline, "jobs did not end:\n{ledger}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    for job_id in &crashing {
        let job = shop.job(*job_id).await;
        assert_eq!(job["state"], "quarantined", "{job}");
        let reason = job["lastError"].as_str().unwrap_or_default();
        assert!(reason.contains("crashed its consumer 3 times"), "{job}");
    }
    assert_eq!(ledger.quarantined, 3, "only the crashing orders are quarantined:\n{ledger}");
    assert_eq!(ledger.succeeded, 197, "{ledger}");
    assert!(ledger.is_clean(), "{ledger}");
    // Each crashing message: one crash among others, then MAX_CRASHES (3) alone.
    assert!((3..=12).contains(&restarts), "{restarts} restarts for 3 crashing messages");
    let depths = parked(&shop).await;
    let inventory_parking = ("inventory.order-placed.parking".to_owned(), Some(3));
    assert!(depths.contains(&inventory_parking), "{depths:?}");
    assert!(depths.iter().filter(|(queue, _)| *queue != inventory_parking.0).all(|(_, d)| *d == Some(0)), "{depths:?}");
    shop.assert_all_running();
}

#[tokio::test]
async fn deliveries_held_through_a_database_outage_and_25_broker_cuts_are_applied_once_and_none_parked() {
    let mut shop = Shop::start(Options::default()).await;
    shop.database_proxy(Service::Inventory).cut();
    shop.place_burst(20).await;
    wait_until_held(&shop, 0).await;
    for _ in 0..25 {
        return_held_delivery(&shop).await;
    }
    shop.database_proxy(Service::Inventory).restore();

    let ledger = shop.assert_books_balance().await;
    assert_eq!(ledger.quarantined, 0, "{ledger}");
    assert!(parked(&shop).await.iter().all(|(_, depth)| *depth == Some(0)), "{:?}", parked(&shop).await);
    let starts: i64 = sqlx::query_scalar("select count(*) from delivery_starts")
        .fetch_one(&shop.inventory)
        .await
        .expect("crash ledger");
    assert_eq!(starts, 0, "no start left counted: none of the returns was a crash");
}

#[tokio::test]
async fn a_message_the_broker_dead_letters_by_its_delivery_limit_still_ends_with_its_job_quarantined() {
    // A tiny broker limit (1 return), far below the crash bound, so the broker acts first.
    let options = Options { consumer_env: vec![("DELIVERY_LIMIT", "1".to_owned())], ..Options::default() };
    let mut shop = Shop::start(options).await;
    shop.database_proxy(Service::Inventory).cut();
    let job_id: Uuid = shop.place(&[("SKU-1", 1)]).await;
    wait_until_held(&shop, 0).await;
    // First return: back and redelivered (held again). Second return: over the limit.
    return_held_delivery(&shop).await;
    cut_broker_connection(&shop).await;

    let job = eventually("the job to be quarantined", WAIT, || async {
        let job = shop.job(job_id).await;
        (job["state"] == "quarantined").then_some(job)
    })
    .await;
    let reason = job["lastError"].as_str().unwrap_or_default();
    assert!(reason.contains("dead-lettered by the broker") && reason.contains("delivery_limit"), "{job}");
    let env = &shop.env;
    assert_eq!(env.queue_depth("inventory.order-placed.parking").await, Some(1));
    assert_eq!(env.queue_depth("inventory.order-placed.dead-lettered").await, Some(0));
    let parked = env.drain("inventory.order-placed.parking").await;
    let headers = parked[0].properties.headers().clone().expect("headers");
    assert!(headers.inner().contains_key("last-error"), "{headers:?}");
    // The broker's dead-lettering added x-death and x-first-death-*: none is carried over.
    assert_eq!(env.published_broker_headers(&parked[0]).await, Vec::<String>::new(), "{headers:?}");
    shop.database_proxy(Service::Inventory).restore();
}

#[tokio::test]
async fn a_result_that_arrives_after_its_job_was_quarantined_ends_the_job_and_its_order_alike() {
    let mut shop = Shop::start(Options::default()).await;
    shop.kill(Service::Billing).await;
    let job = shop.place(&[("SKU-1", 1)]).await;
    eventually("inventory's step", WAIT, || async { (shop.order_status(job).await == "reserved").then_some(()) }).await;
    // Inventory's message, applied, is dead-lettered by the broker after its commit (its ack lost
    // until the delivery limit): it is parked and the job quarantined, while billing has yet to
    // invoice it.
    shop.copy_order_placed(job, "inventory.order-placed.dead-lettered", &[]).await;
    shop.wait_for_state(job, "quarantined").await;
    assert_eq!(shop.order_status(job).await, "failed");

    // The invoice proves the order went through: the job ends succeeded, and its order invoiced,
    // not `failed` for good (found by docs/model/jobs.pml).
    shop.restart(Service::Billing).await;
    shop.wait_for_state(job, "succeeded").await;
    assert_eq!(shop.order_status(job).await, "invoiced");
}

/// A quorum queue's leader change can leave a delivery that the broker counts as handed to a
/// consumer, unacked, but that never reached it (rabbitmq-server#15473): a consumer that gets no
/// later delivery would never see it, and it would come back only when its channel closes. The
/// proxy swallows the inventory worker's one delivery so; the idle worker renews its channels
/// (`IDLE_RENEWAL`) and the order goes through, applied once, without a reconnect.
#[tokio::test]
async fn a_delivery_lost_on_its_way_to_an_idle_consumer_comes_back_when_its_channels_are_renewed() {
    let options = Options { consumer_env: vec![("IDLE_RENEWAL", "2s".to_owned())], ..Options::default() };
    let mut shop = Shop::start(options).await;
    let sessions = shop.metric(Service::Inventory, CONSUMER_SESSIONS).await;
    shop.broker_proxy(Service::Inventory).swallow_deliveries(1);
    let job = shop.place(&[("SKU-1", 1)]).await;
    shop.wait_for_state(job, "succeeded").await;

    assert_eq!(shop.broker_proxy(Service::Inventory).swallowed(), 1, "the delivery never reached the worker");
    let ledger = shop.assert_books_balance().await;
    assert_eq!(ledger.succeeded, 1, "{ledger}");
    assert_eq!(shop.metric(Service::Inventory, CONSUMER_SESSIONS).await, sessions, "renewed in the same session");
}
