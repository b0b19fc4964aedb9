//! Every consumer a message is meant for gets it (issue 56, row 1; decision 0030). A cancelled
//! order's `order.ended` goes to inventory and to billing; the broker returns a `mandatory`
//! message only when no queue takes it. So on a first deploy where inventory starts last, billing
//! took an order's end and inventory, once up, reserved stock for an order that had ended and
//! never heard of its end: the order stayed `compensating` and its stock held, for good. The relay
//! now holds a row whose message would reach fewer queues than the shop's topology binds to it,
//! until they exist.

use lapin::options::QueueDeleteOptions;
use serde_json::Value;
use testkit::{
    eventually,
    shop::{Options, Service, Shop, WAIT},
};

/// Inventory's endpoint, whose queue a first deploy does not have until inventory starts.
const INVENTORY: &str = "inventory.order-placed";

/// The broker as a first deploy leaves it before inventory has started: no queue of inventory's
/// and so no binding. (The databases are as the harness left them; the relay's hold is about the
/// broker.)
async fn as_if_inventory_never_started(shop: &mut Shop) {
    shop.kill(Service::Inventory).await;
    let connection = shop.env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    channel.queue_delete(INVENTORY.into(), QueueDeleteOptions::default()).await.expect("delete inventory's queue");
    let _ = connection.close(200, "bye".into()).await;
}

/// How many of the orders outbox's `message_type` rows wait unpublished, and their reasons.
async fn unpublished(shop: &Shop, message_type: &str) -> Vec<String> {
    sqlx::query_scalar(
        "select coalesce(last_error, '') from outbox where message_type = $1 and published_at is null and parked_at is null",
    )
    .bind(message_type)
    .fetch_all(&shop.orders)
    .await
    .expect("outbox rows")
}

#[tokio::test]
async fn on_a_first_deploy_where_inventory_starts_last_every_order_still_ends_and_gives_its_stock_back() {
    let options = Options { consumer_env: vec![("ORDER_DEADLINE", "6s".into())], ..Options::default() };
    let mut shop = Shop::start(options).await;
    as_if_inventory_never_started(&mut shop).await;

    // One order cancelled by its customer, two left to their deadline.
    let cancelled = shop.place(&[("SKU-2", 1)]).await;
    let expiring = [shop.place(&[("SKU-3", 1)]).await, shop.place(&[("SKU-4", 1)]).await];
    let order_id = shop.job(cancelled).await["orderId"].as_str().expect("order id").to_owned();
    let response = shop.cancel(&order_id).await;
    assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
    for job_id in [cancelled, expiring[0], expiring[1]] {
        eventually("the order's end to be decided", WAIT, || async {
            (shop.order_status(job_id).await == "cancelled").then_some(())
        })
        .await;
    }

    // Each order's end waits for inventory's queue: billing has not taken one, and the relay says
    // what it holds and why.
    eventually("the relay to hold every order's end", WAIT, || async {
        let ends = unpublished(&shop, "order.ended").await;
        (ends.len() == 3 && ends.iter().all(|reason| reason.contains(INVENTORY))).then_some(())
    })
    .await;
    assert!(
        shop.metric_value(Service::Relay, "outbox_topology_missing").await >= 1.0,
        "the relay reports no missing queue"
    );
    // What the operator's check says (`msgctl topology check`): the one queue, and exit 1.
    let checked = shop.env.msgctl(&["topology", "check"]).await;
    let listed = String::from_utf8_lossy(&checked.stdout);
    assert_eq!(checked.status.code(), Some(1), "{checked:?}");
    assert_eq!(listed.lines().collect::<Vec<_>>(), [format!("missing queue {INVENTORY}")], "{checked:?}");
    let billed_ends: i64 = sqlx::query_scalar("select count(*) from inbox where message_type = 'order.ended'")
        .fetch_one(&shop.billing)
        .await
        .expect("billing's inbox");
    assert_eq!(billed_ends, 0, "billing took an order's end that inventory could not get");

    // Inventory starts: it declares its queue, gets each order's placing and then its end, and
    // every order ends with its stock back.
    shop.restart(Service::Inventory).await;
    for job_id in [cancelled, expiring[0], expiring[1]] {
        let job: Value = shop.wait_for_state(job_id, "cancelled").await;
        assert_eq!(job["state"], "cancelled", "{job}");
    }
    let ledger = shop.assert_books_balance().await;
    assert_eq!(ledger.held_by_ended, 0, "{ledger}");
    eventually("the relay to find nothing missing", WAIT, || async {
        (shop.metric_value(Service::Relay, "outbox_topology_missing").await == 0.0).then_some(())
    })
    .await;
    let checked = shop.env.msgctl(&["topology", "check"]).await;
    assert!(checked.status.success(), "{checked:?}");
    shop.stop().await;
}

/// A row held for a missing queue is never parked, however long the queue takes: the hold is the
/// topology's state, not the row's (a refused row is parked after `RELAY_MAX_ATTEMPTS`).
#[tokio::test]
async fn a_row_held_longer_than_the_relay_s_attempts_is_not_parked() {
    let options = Options { relay_env: vec![("RELAY_MAX_ATTEMPTS", "2".into())], ..Options::default() };
    let mut shop = Shop::start(options).await;
    as_if_inventory_never_started(&mut shop).await;
    let job_id = shop.place(&[("SKU-2", 1)]).await;
    let attempts = || async {
        sqlx::query_scalar::<_, i32>("select attempts from outbox where message_type = 'order.placed'")
            .fetch_one(&shop.orders)
            .await
            .expect("the row")
    };
    eventually("the held row to be tried more than RELAY_MAX_ATTEMPTS times", WAIT, || async {
        (attempts().await > 3).then_some(())
    })
    .await;
    let parked: i64 = sqlx::query_scalar("select count(*) from outbox where parked_at is not null")
        .fetch_one(&shop.orders)
        .await
        .expect("parked rows");
    assert_eq!(parked, 0, "a held row was parked");
    // Held, not returned: no publish left the relay, and none counts toward parking.
    let (refusals, reason): (i32, String) =
        sqlx::query_as("select refusals, last_error from outbox where message_type = 'order.placed'")
            .fetch_one(&shop.orders)
            .await
            .expect("the row");
    assert_eq!(refusals, 0);
    assert!(reason.starts_with("held:") && reason.contains(INVENTORY), "{reason}");
    shop.restart(Service::Inventory).await;
    shop.wait_for_state(job_id, "succeeded").await;
    shop.stop().await;
}
