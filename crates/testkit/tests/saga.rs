//! The saga (issue 41, decision 0023) on the real shop, as processes: every order ends, and an end
//! other than `invoiced` leaves no stock held and no invoice standing. Billing declines; an
//! operator abandons a parked order; a customer cancels before the relay publishes, between
//! reservation and invoice, and after the invoice; a deadline expires while billing is down; an
//! order's end waits at inventory behind its placing, or goes unordered when the relay is still
//! retrying a placing the broker refuses; each undo is safe against the message it undoes
//! arriving late; an order's end withdraws its deadline; and billing gets an order's end only
//! when it must undo.

use serde_json::Value;
use shop::{End, InventoryReserved, OrderEnded, OrderLine, OrderPlaced};
use testkit::{
    eventually, http,
    shop::{Options, Service, Shop, WAIT},
};
use uuid::Uuid;

const BILLING: &str = "billing.inventory-reserved";

/// `POST /orders/{id}/cancel`: its status and body.
async fn cancel(shop: &Shop, order_id: &str) -> (u16, Value) {
    let response = shop.cancel(order_id).await;
    (response.status, response.json())
}

/// `(available, reserved, settled)` of `sku`.
async fn stock(shop: &Shop, sku: &str) -> (i32, i32, i32) {
    sqlx::query_as("select available, reserved, settled from stock where sku = $1")
        .bind(sku)
        .fetch_one(&shop.inventory)
        .await
        .expect("stock row")
}

/// The order's invoices in billing: `(state, total)` of each.
async fn invoices(shop: &Shop, order_id: Uuid) -> Vec<(String, i64)> {
    sqlx::query_as("select state, total_cents from invoices where order_id = $1")
        .bind(order_id)
        .fetch_all(&shop.billing)
        .await
        .expect("invoices")
}

/// Set the order's reservation to `state` by hand, moving `held` units of SKU-2 from settled to
/// held stock with it (negative: back).
async fn settle_by_hand(shop: &Shop, order_id: Uuid, state: &str, held: i32) {
    sqlx::query("update reservations set state = $1 where order_id = $2")
        .bind(state)
        .bind(order_id)
        .execute(&shop.inventory)
        .await
        .expect("the reservation");
    sqlx::query("update stock set reserved = reserved + $1, settled = settled - $1 where sku = 'SKU-2'")
        .bind(held)
        .execute(&shop.inventory)
        .await
        .expect("its stock");
}

/// Take `quantity` of SKU-5 into `reserved` by hand, outside any reservation (negative: give it
/// back).
async fn take_by_hand(shop: &Shop, quantity: i32) {
    sqlx::query("update stock set reserved = reserved + $1, available = available - $1 where sku = 'SKU-5'")
        .bind(quantity)
        .execute(&shop.inventory)
        .await
        .expect("the stock");
}

/// Wait until `pool`'s inbox has applied `message_id`.
async fn applied(pool: &sqlx::PgPool, message_id: Uuid) {
    eventually("the message to be applied", WAIT, || async {
        let applied: bool = sqlx::query_scalar("select exists (select from inbox where message_id = $1)")
            .bind(message_id)
            .fetch_one(pool)
            .await
            .expect("inbox");
        applied.then_some(())
    })
    .await;
}

/// Whether job `job_id`'s `order.deadline` is in the orders outbox, published or not.
async fn deadline_kept(shop: &Shop, job_id: Uuid) -> bool {
    sqlx::query_scalar(
        "select exists (select from outbox where message_type = 'order.deadline' and payload ->> 'jobId' = $1)",
    )
    .bind(job_id.to_string())
    .fetch_one(&shop.orders)
    .await
    .expect("the outbox")
}

fn order_id(job: &Value) -> Uuid {
    job["orderId"].as_str().and_then(|id| id.parse().ok()).expect("orderId")
}

/// Every order ended, every books' rule holds (no stock held by an ended order, no invoice
/// standing for an order not invoiced), and `sku` is back to where it started, none held.
async fn assert_given_back(shop: &mut Shop, skus: &[&str]) {
    let ledger = shop.assert_books_balance().await;
    assert_eq!(ledger.held_by_ended, 0, "{ledger}");
    for sku in skus {
        let initial = shop.initial_stock[*sku];
        assert_eq!(stock(shop, sku).await, (initial as i32, 0, 0), "{sku} is not back");
    }
}

#[tokio::test]
async fn a_declined_order_ends_declined_with_its_stock_back_and_no_invoice() {
    let mut shop = Shop::start(Options { demo_faults: true, ..Options::default() }).await;
    let job_id = shop.place(&[("SKU-1", 1), ("DECLINE-1", 2)]).await;
    let job = shop.wait_for_state(job_id, "declined").await;
    assert!(job["lastError"].as_str().is_some_and(|reason| reason.contains("declined")), "{job}");
    let order_id = order_id(&job);
    assert_eq!(shop.order_status(job_id).await, "declined");
    // Billing never invoiced it; its void left a fence.
    assert_eq!(invoices(&shop, order_id).await, [("void".to_owned(), 0)]);
    assert_given_back(&mut shop, &["SKU-1", "DECLINE-1"]).await;
    // Declined, it can no longer be cancelled.
    let (status, problem) = cancel(&shop, &order_id.to_string()).await;
    assert_eq!(status, 409, "{problem}");
}

#[tokio::test]
async fn a_billing_poison_order_abandoned_by_an_operator_ends_cancelled_and_a_late_copy_changes_nothing() {
    let options = Options { demo_faults: true, max_attempts: 2, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let job_id = shop.place(&[("SKU-2", 1), ("BILLPOISON-1", 1)]).await;
    let job = shop.wait_for_state(job_id, "quarantined").await;
    let order_id = order_id(&job);
    // Parked in billing, after inventory reserved it: the stock is held, the order is not final.
    assert_eq!(stock(&shop, "BILLPOISON-1").await.1, 1);
    assert_eq!(shop.order_status(job_id).await, "failed");

    let job_arg = job_id.to_string();
    let output = shop.env.msgctl(&["parked", "abandon", "--job", &job_arg, "--note", "poison"]).await;
    assert!(output.status.success(), "{output:?}");
    let job = shop.wait_for_state(job_id, "cancelled").await;
    assert!(job["lastError"].as_str().is_some_and(|reason| reason.contains("poison")), "{job}");
    assert_eq!(shop.order_status(job_id).await, "cancelled");
    assert_eq!(shop.env.queue_depth(&format!("{BILLING}.parking")).await, Some(0), "the message left parking");

    // Nothing is left to redrive of it.
    let output = shop.env.msgctl(&["parked", "redrive", "--endpoint", BILLING, "--job", &job_arg]).await;
    assert!(!output.status.success(), "something was redriven: {output:?}");

    // A copy of its inventory.reserved arriving now (as a redrive of a copy parked elsewhere would),
    // with the fault gone, finds the fence: no invoice.
    shop.kill(Service::Billing).await;
    shop.restart_with(Service::Billing, &[("DEMO_FAULTS", "false")]).await;
    let late = InventoryReserved {
        order_id,
        job_id,
        reservation_id: Uuid::now_v7(),
        lines: vec![OrderLine { sku: "SKU-2".into(), quantity: 1 }],
        deadline: None,
    };
    let copy = shop.env.publish(&late, job_id, 1).await;
    applied(&shop.billing, copy).await;
    assert_given_back(&mut shop, &["SKU-2", "BILLPOISON-1"]).await;
    assert_eq!(invoices(&shop, order_id).await, [("void".to_owned(), 0)]);
    assert_eq!(shop.job(job_id).await["state"], "cancelled");
}

#[tokio::test]
async fn a_cancel_before_the_relay_publishes_ends_the_order_cancelled_and_takes_nothing() {
    let mut shop = Shop::start(Options::default()).await;
    shop.kill(Service::Relay).await;
    let job_id = shop.place(&[("SKU-3", 2)]).await;
    let order_id = order_id(&shop.job(job_id).await);
    let (status, body) = cancel(&shop, &order_id.to_string()).await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["jobId"].as_str(), Some(job_id.to_string().as_str()));
    assert_eq!(shop.job(job_id).await["state"], "compensating");
    // Idempotent.
    assert_eq!(cancel(&shop, &order_id.to_string()).await.0, 202);
    shop.restart(Service::Relay).await;
    shop.wait_for_state(job_id, "cancelled").await;
    assert_given_back(&mut shop, &["SKU-3"]).await;
    assert!(invoices(&shop, order_id).await.iter().all(|(state, _)| state == "void"));
}

/// Inventory is ordered by the order (`shop::order_key`, decision 0024): a cancel's `order.ended`
/// that arrives while the order's `order.placed` waits for its retry waits behind it, so the stock
/// is reserved and then released, not fenced. (Unordered, the release would come first and leave a
/// fence, and the `order.placed` would then reserve nothing.)
#[tokio::test]
async fn an_orders_end_waits_at_inventory_behind_its_placing() {
    let mut shop = Shop::start(Options { demo_faults: true, ..Options::default() }).await;
    shop.kill(Service::Relay).await;
    // FLAKY-1 fails inventory's first two attempts; the relay sends order.placed, then order.ended.
    let job_id = shop.place(&[("FLAKY-1", 1), ("SKU-4", 2)]).await;
    let order_id = order_id(&shop.job(job_id).await);
    assert_eq!(cancel(&shop, &order_id.to_string()).await.0, 202);
    shop.restart(Service::Relay).await;
    shop.wait_for_state(job_id, "cancelled").await;
    assert_given_back(&mut shop, &["FLAKY-1", "SKU-4"]).await;
    let reservation: (String, Value) = sqlx::query_as("select state, lines from reservations where order_id = $1")
        .bind(order_id)
        .fetch_one(&shop.inventory)
        .await
        .expect("the reservation");
    assert_eq!(reservation.0, "released");
    assert_eq!(
        reservation.1.as_array().map(Vec::len),
        Some(2),
        "found a fence where a released reservation should be: {reservation:?}"
    );
    let deferred = r#"messages_handled_total{endpoint="inventory.order-placed",outcome="deferred""#;
    assert!(shop.metric(Service::Inventory, deferred).await > 0, "order.ended did not wait");
}

/// Issue 56, row 7: an order cancelled while the relay still retries its `order.placed` (the broker
/// refuses it: an internal exchange takes no publish), before the relay would park it. The row is
/// withdrawn and the end goes out unordered, so the order ends `cancelled` with nothing taken.
/// Sent ordered, the end would wait at inventory behind a placing that the relay parks later, and
/// the job would stay `compensating`.
#[tokio::test]
async fn an_order_cancelled_while_the_relay_retries_its_placing_ends_with_nothing_taken() {
    let relay_env = [("RELAY_MAX_ATTEMPTS", "1000"), ("RELAY_RETRY_INITIAL", "50ms"), ("RELAY_RETRY_MAX", "200ms")];
    let relay_env = relay_env.iter().map(|(name, value)| (*name, (*value).to_owned())).collect();
    let mut shop = Shop::start(Options { relay_env, ..Options::default() }).await;
    shop.kill(Service::Relay).await;
    let job_id = shop.place(&[("SKU-3", 2)]).await;
    let placed = shop.refuse_placing(job_id).await;
    shop.restart(Service::Relay).await;
    let attempts = || async {
        sqlx::query_as::<_, (i32, bool)>("select attempts, parked_at is null from outbox where message_id = $1")
            .bind(placed)
            .fetch_optional(&shop.orders)
            .await
            .expect("the row")
    };
    eventually("the relay to retry the refused placing", WAIT, || async {
        attempts().await.filter(|&(attempts, unparked)| attempts > 0 && unparked).map(drop)
    })
    .await;

    let order_id = order_id(&shop.job(job_id).await);
    assert_eq!(cancel(&shop, &order_id.to_string()).await.0, 202);
    shop.wait_for_state(job_id, "cancelled").await;
    assert_eq!(attempts().await, None, "the placing is withdrawn");
    assert_eq!(stock(&shop, "SKU-3").await.1, 0, "nothing held");
    shop.assert_books_balance().await;
}

/// An order cancelled before the relay ever tried its placing: the end goes out ordered behind it,
/// since nothing says yet that the placing will not come. The relay then parks the placing (the
/// broker refuses it for good), and the orders service, hearing of it (`job.quarantined` from
/// `outbox:orders`), sends the end again unordered: the order ends `cancelled` with nothing taken.
/// Without that, the ordered end waited at inventory for a place nothing fills and the job stayed
/// `compensating` (issue 56, row 7: "a first failure the relay does not count" is the same case,
/// the placing untried as far as `decide` can see).
#[tokio::test]
async fn an_order_cancelled_before_its_placing_was_tried_ends_when_the_relay_parks_the_placing() {
    let relay_env = [("RELAY_MAX_ATTEMPTS", "2"), ("RELAY_RETRY_INITIAL", "50ms"), ("RELAY_RETRY_MAX", "200ms")];
    let relay_env = relay_env.iter().map(|(name, value)| (*name, (*value).to_owned())).collect();
    let mut shop = Shop::start(Options { relay_env, ..Options::default() }).await;
    let (job_id, placed) = cancelled_behind_a_refused_placing(&mut shop).await;
    let ordered: bool = sqlx::query_scalar(
        "select headers ? 'ordering_key' from outbox where message_type = 'order.ended' and payload->>'jobId' = $1::text",
    )
    .bind(job_id)
    .fetch_one(&shop.orders)
    .await
    .expect("the order's end");
    assert!(ordered, "the end goes out behind a placing never tried");

    shop.restart(Service::Relay).await;
    shop.wait_for_state(job_id, "cancelled").await;
    let parked: bool = sqlx::query_scalar("select parked_at is not null from outbox where message_id = $1")
        .bind(placed)
        .fetch_one(&shop.orders)
        .await
        .expect("the placing");
    assert!(parked, "the relay parked the placing");
    assert_eq!(stock(&shop, "SKU-3").await.1, 0, "nothing held");
    // The operator's part: the parked placing of an ended order goes (`msgctl outbox stuck` lists it).
    discard(&shop, placed).await;
    assert_one_cancelled(&mut shop).await;
}

/// The state an earlier release left behind (before issue 56 mended it): an order's end sent
/// ordered behind a placing the relay parked, the job `compensating` for good. The operator's
/// `msgctl outbox discard` of the parked placing ends it: its `job.abandoned` sends the end again,
/// unordered, and the order ends `cancelled` with nothing taken.
#[tokio::test]
async fn a_job_left_compensating_behind_a_parked_placing_is_ended_by_discarding_it() {
    let mut shop = Shop::start(Options::default()).await;
    let (job_id, placed) = cancelled_behind_a_refused_placing(&mut shop).await;
    // Parked as the relay parks a refused row, but with no `job.quarantined` heard of it.
    sqlx::query("update outbox set parked_at = now(), attempts = 1, last_error = 'refused' where message_id = $1")
        .bind(placed)
        .execute(&shop.orders)
        .await
        .expect("park the placing");
    shop.restart(Service::Relay).await;
    // Billing voids (it waits for no placing); inventory holds the ordered end behind the placing.
    eventually("billing to answer", WAIT, || async {
        let voided: bool = sqlx::query_scalar("select voided_at is not null from jobs where id = $1")
            .bind(job_id)
            .fetch_one(&shop.orders)
            .await
            .expect("the job");
        voided.then_some(())
    })
    .await;
    assert_eq!(shop.job(job_id).await["state"], "compensating", "stuck behind the parked placing");

    discard(&shop, placed).await;
    shop.wait_for_state(job_id, "cancelled").await;
    assert_eq!(stock(&shop, "SKU-3").await.1, 0, "nothing held");
    assert_one_cancelled(&mut shop).await;
}

/// With the relay stopped, an order of two SKU-3 whose `order.placed` the broker will refuse
/// ([`Shop::refuse_placing`]), cancelled before the relay ever tries it (202): its end goes out
/// ordered behind the placing. The job and the placing's message id.
async fn cancelled_behind_a_refused_placing(shop: &mut Shop) -> (Uuid, Uuid) {
    shop.kill(Service::Relay).await;
    let job_id = shop.place(&[("SKU-3", 2)]).await;
    let placed = shop.refuse_placing(job_id).await;
    let order_id = order_id(&shop.job(job_id).await);
    assert_eq!(cancel(shop, &order_id.to_string()).await.0, 202);
    (job_id, placed)
}

/// `msgctl outbox discard` of a parked row, which must succeed.
async fn discard(shop: &Shop, message_id: Uuid) {
    let discarded = shop.env.msgctl(&["outbox", "discard", &message_id.to_string()]).await;
    assert!(discarded.status.success(), "{discarded:?}");
}

/// The books balance, with the one order cancelled and nothing quarantined.
async fn assert_one_cancelled(shop: &mut Shop) {
    let ledger = shop.assert_books_balance().await;
    assert_eq!((ledger.cancelled, ledger.quarantined), (1, 0), "{ledger}");
}

#[tokio::test]
async fn a_cancel_between_reservation_and_invoice_voids_the_invoice_billing_makes_late() {
    let mut shop = Shop::start(Options::default()).await;
    shop.kill(Service::Billing).await;
    let job_id = shop.place(&[("SKU-4", 3)]).await;
    eventually("inventory to reserve it", WAIT, || async {
        (shop.order_status(job_id).await == "reserved").then_some(())
    })
    .await;
    let order_id = order_id(&shop.job(job_id).await);
    let (status, body) = cancel(&shop, &order_id.to_string()).await;
    assert_eq!(status, 202, "{body}");
    // Inventory has released it; billing is down, so the job waits for the void.
    eventually("inventory to release it", WAIT, || async { (stock(&shop, "SKU-4").await.1 == 0).then_some(()) }).await;
    assert_eq!(shop.job(job_id).await["state"], "compensating");
    // Billing comes back and takes its queue in order: the reservation (an invoice, whose
    // invoice.created the orders service ignores), then order.ended (the invoice is voided).
    shop.restart(Service::Billing).await;
    shop.wait_for_state(job_id, "cancelled").await;
    assert_eq!(shop.order_status(job_id).await, "cancelled");
    assert_given_back(&mut shop, &["SKU-4"]).await;
    let invoices = invoices(&shop, order_id).await;
    assert!(matches!(invoices.as_slice(), [(state, _)] if state == "void"), "{invoices:?}");

    // Its story (`GET /jobs/{id}/events`) tells all of it: the order's steps in the order's trace,
    // the cancel and its compensation in the cancel's.
    let story = shop.wait_for_story(job_id, "ended").await;
    let events = story["events"].as_array().expect("events");
    let kinds: Vec<&str> = events.iter().map(|event| event["kind"].as_str().expect("kind")).collect();
    let mut sorted = kinds.clone();
    sorted.sort_unstable();
    let whole = ["accepted", "compensating", "ended", "invoiced", "published", "released", "reserved", "voided"];
    assert_eq!(sorted, whole, "{story}");
    let at = |kind: &str| kinds.iter().position(|k| *k == kind).expect("kind");
    assert_eq!((at("accepted"), at("ended")), (0, kinds.len() - 1), "{story}");
    assert!(at("reserved") < at("compensating") && at("compensating") < at("released"), "{story}");
    let event = |kind: &str| &events[at(kind)];
    assert_eq!(event("compensating")["detail"], "cancelled by the customer");
    assert_eq!(event("ended")["detail"], "cancelled");
    assert_eq!(event("reserved")["endpoint"], "inventory.order-placed");
    let order_trace = story["traceId"].as_str().expect("the order's trace");
    for kind in ["accepted", "published", "reserved", "invoiced"] {
        assert_eq!(event(kind)["traceId"], order_trace, "{kind} is in the order's trace: {story}");
    }
    let cancel_trace = event("compensating")["traceId"].as_str().expect("the cancel's trace");
    assert_ne!(cancel_trace, order_trace);
    for kind in ["released", "voided", "ended"] {
        assert_eq!(event(kind)["traceId"], cancel_trace, "{kind} is in the cancel's trace: {story}");
    }
}

#[tokio::test]
async fn an_invoiced_order_cannot_be_cancelled_and_its_stock_is_settled() {
    let mut shop = Shop::start(Options::default()).await;
    let before = stock(&shop, "SKU-1").await;
    let job_id = shop.place(&[("SKU-1", 2)]).await;
    let order_id = order_id(&shop.wait_for_state(job_id, "succeeded").await);
    let (status, problem) = cancel(&shop, &order_id.to_string()).await;
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["status"], 409);
    assert_eq!(shop.job(job_id).await["state"], "succeeded");
    let ledger = shop.assert_books_balance().await;
    assert_eq!(ledger.held_by_ended, 0);
    assert_eq!(stock(&shop, "SKU-1").await, (before.0 - 2, 0, before.2 + 2));
    assert_eq!(invoices(&shop, order_id).await.len(), 1);
    // An unknown order: 404; a malformed id: 400.
    assert_eq!(cancel(&shop, &Uuid::now_v7().to_string()).await.0, 404);
    assert_eq!(cancel(&shop, "nope").await.0, 400);
}

#[tokio::test]
async fn an_order_whose_deadline_passes_while_billing_is_down_ends_cancelled_and_billing_invoices_nothing() {
    let options = Options { consumer_env: vec![("ORDER_DEADLINE", "3s".into())], ..Options::default() };
    let mut shop = Shop::start(options).await;
    shop.kill(Service::Billing).await;
    let job_id = shop.place(&[("SKU-5", 2)]).await;
    let order_id = order_id(&shop.job(job_id).await);
    // The deadline cancels it; inventory gives the stock back; the void waits for billing.
    eventually("the deadline to cancel the order", WAIT, || async {
        (shop.order_status(job_id).await == "cancelled").then_some(())
    })
    .await;
    eventually("inventory to release it", WAIT, || async { (stock(&shop, "SKU-5").await.1 == 0).then_some(()) }).await;
    assert_eq!(shop.job(job_id).await["state"], "compensating");
    shop.restart(Service::Billing).await;
    let job = shop.wait_for_state(job_id, "cancelled").await;
    assert!(job["lastError"].as_str().is_some_and(|reason| reason.contains("deadline")), "{job}");
    assert_given_back(&mut shop, &["SKU-5"]).await;
    // Billing declined the expired reservation and fenced the order: no invoice stood, ever.
    assert_eq!(invoices(&shop, order_id).await, [("void".to_owned(), 0)]);
}

/// The move that ends an order withdraws its `order.deadline` from the outbox (issue 59): once
/// invoiced, rejected or cancelled, an order's deadline is neither published nor delivered. A
/// deadline the relay holds (it may be publishing it) is not waited for: it stays, and when it
/// comes it finds the order ended.
#[tokio::test]
async fn an_order_that_ends_withdraws_its_deadline_unless_the_relay_holds_it() {
    let mut shop = Shop::start(Options::default()).await;
    let invoiced = shop.place(&[("SKU-1", 1)]).await;
    let rejected = shop.place(&[("NOPE-9", 1)]).await;
    shop.wait_for_state(invoiced, "succeeded").await;
    shop.wait_for_state(rejected, "rejected").await;
    // Two cancelled while inventory is down: each runs, with its deadline, until its cancel.
    shop.kill(Service::Inventory).await;
    let cancelled = shop.place(&[("SKU-3", 1)]).await;
    let held = shop.place(&[("SKU-3", 1)]).await;
    assert!(deadline_kept(&shop, cancelled).await, "a running order keeps its deadline");
    // The relay's claim, as it holds a row: locked until its transaction ends.
    let mut relay = shop.orders.begin().await.expect("a transaction");
    sqlx::query("select from outbox where message_type = 'order.deadline' and payload ->> 'jobId' = $1 for update")
        .bind(held.to_string())
        .fetch_one(&mut *relay)
        .await
        .expect("the held deadline");
    for job_id in [cancelled, held] {
        let (status, body) = cancel(&shop, &order_id(&shop.job(job_id).await).to_string()).await;
        assert_eq!(status, 202, "the cancel waited for nothing: {body}");
    }
    relay.rollback().await.expect("the relay's transaction");
    for job_id in [invoiced, rejected, cancelled] {
        assert!(!deadline_kept(&shop, job_id).await, "job {job_id} ended and its deadline is still in the outbox");
    }
    assert!(deadline_kept(&shop, held).await, "the relay's row was taken from under it");
    shop.restart(Service::Inventory).await;
    shop.wait_for_state(cancelled, "cancelled").await;
    shop.wait_for_state(held, "cancelled").await;
    assert_given_back(&mut shop, &["SKU-3"]).await;
}

/// A cancel whose job another transaction holds past the API's `lock_timeout` (3 s; on a loaded
/// machine its `statement_timeout`, 5 s, may end the wait first) answers 503 with `Retry-After`,
/// nothing written, and the same cancel succeeds once the lock is gone. Until 2026-12-07 it
/// answered 500 "internal error", which a client does not retry.
#[tokio::test]
async fn a_cancel_behind_a_lock_held_past_the_timeout_answers_503_and_succeeds_when_retried() {
    let mut shop = Shop::start(Options::default()).await;
    shop.kill(Service::Inventory).await;
    let job_id = shop.place(&[("SKU-3", 1)]).await;
    let order_id = order_id(&shop.job(job_id).await).to_string();
    let mut holder = shop.orders.begin().await.expect("a transaction");
    sqlx::query("select from jobs where id = $1 for update").bind(job_id).fetch_one(&mut *holder).await.expect("lock");
    let response = shop.cancel(&order_id).await;
    assert_eq!(response.status, 503, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.header("retry-after"), Some("1"));
    assert_eq!(response.json()["status"], 503, "a problem document");
    holder.rollback().await.expect("release");
    assert!(deadline_kept(&shop, job_id).await, "the refused cancel wrote nothing");
    let (status, body) = cancel(&shop, &order_id).await;
    assert_eq!(status, 202, "{body}");
    shop.restart(Service::Inventory).await;
    shop.wait_for_state(job_id, "cancelled").await;
    assert_given_back(&mut shop, &["SKU-3"]).await;
}

/// `order.ended` is routed by its end (issue 59): an invoiced order's end reaches inventory, which
/// settles, and not billing, which has nothing to undo. An end under the key of the releases
/// before (`order.ended`), as their rows still unpublished at an upgrade carry, reaches both.
#[tokio::test]
async fn an_order_s_end_reaches_billing_only_to_be_undone_and_under_the_earlier_key_too() {
    let mut shop = Shop::start(Options::default()).await;
    let job_id = shop.place(&[("SKU-1", 1)]).await;
    shop.wait_for_state(job_id, "succeeded").await;
    // Billing stopped: whatever reached its queue from now on stays there, ready.
    shop.kill(Service::Billing).await;
    let ended: Uuid = sqlx::query_scalar(
        "select message_id from outbox where message_type = 'order.ended' and payload ->> 'jobId' = $1",
    )
    .bind(job_id.to_string())
    .fetch_one(&shop.orders)
    .await
    .expect("the order's end");
    applied(&shop.inventory, ended).await;
    let billed: bool = sqlx::query_scalar("select exists (select from inbox where message_id = $1)")
        .bind(ended)
        .fetch_one(&shop.billing)
        .await
        .expect("billing's inbox");
    assert!(!billed, "billing took an invoiced order's end");
    assert_eq!(shop.env.queue_depth(BILLING).await, Some(0), "an invoiced order's end reached billing's queue");

    // An earlier release's end, of an order no one knows: inventory fences it, and billing's
    // queue holds it.
    let (order_id, job_id) = (Uuid::now_v7(), Uuid::now_v7());
    let earlier = OrderEnded { order_id, job_id, end: End::Cancelled, reason: Some("test".into()) };
    let message_id = shop.env.publish_under(&earlier, shop::topology::ENDED_BEFORE_ROUTING_BY_END, job_id, 1).await;
    applied(&shop.inventory, message_id).await;
    assert_eq!(shop.env.queue_depth(BILLING).await, Some(1), "the earlier key's end did not reach billing");
}

#[tokio::test]
async fn a_release_that_overtakes_its_reservation_leaves_a_fence_and_the_reservation_takes_nothing() {
    let shop = Shop::start(Options::default()).await;
    // Messages of an order the orders service does not know, straight to the broker: the status
    // consumer parks their answers (unknown job), which is not what this test is about.
    let (order_id, job_id) = (Uuid::now_v7(), Uuid::now_v7());
    let ended = OrderEnded { order_id, job_id, end: End::Cancelled, reason: Some("test".into()) };
    let release = shop.env.publish(&ended, job_id, 1).await;
    applied(&shop.inventory, release).await;
    let placed = OrderPlaced {
        order_id,
        job_id,
        customer_id: "late".into(),
        lines: vec![OrderLine { sku: "SKU-2".into(), quantity: 5 }],
        deadline: None,
    };
    let reservation = shop.env.publish(&placed, job_id, 1).await;
    applied(&shop.inventory, reservation).await;
    let initial = shop.initial_stock["SKU-2"];
    assert_eq!(stock(&shop, "SKU-2").await, (initial as i32, 0, 0), "the late reservation took stock");
    let reservations: i64 = sqlx::query_scalar("select count(*) from reservations where order_id = $1")
        .bind(order_id)
        .fetch_one(&shop.inventory)
        .await
        .expect("count");
    assert_eq!(reservations, 1, "the fence only");
    let fence: (String, Value) = sqlx::query_as("select state, lines from reservations where order_id = $1")
        .bind(order_id)
        .fetch_one(&shop.inventory)
        .await
        .expect("fence");
    assert_eq!(fence, ("released".to_owned(), serde_json::json!([])));
}

#[tokio::test]
async fn purging_a_parked_order_ends_it_cancelled_and_what_it_took_is_given_back() {
    let options = Options { demo_faults: true, max_attempts: 2, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let job_id = shop.place(&[("SKU-3", 2), ("BILLPOISON-1", 1)]).await;
    shop.wait_for_state(job_id, "quarantined").await;
    assert_eq!(stock(&shop, "SKU-3").await.1, 2, "held while parked");
    let output = shop.env.msgctl(&["parked", "purge", "--endpoint", BILLING, "--yes"]).await;
    assert!(output.status.success(), "{output:?}");
    shop.wait_for_state(job_id, "cancelled").await;
    assert_eq!(shop.env.queue_depth(&format!("{BILLING}.parking")).await, Some(0));
    assert_given_back(&mut shop, &["SKU-3", "BILLPOISON-1"]).await;
}

#[tokio::test]
async fn a_reservation_leaked_by_hand_and_an_unanswered_compensation_are_disagreements_in_the_metric_and_msgctl_books()
{
    let mut shop = Shop::start(Options::default()).await;
    // The API checks the books against the other two databases, often and with little grace.
    let vars = [
        ("BOOKS_INVENTORY_URL", shop.env.database_url("inventory")),
        ("BOOKS_BILLING_URL", shop.env.database_url("billing")),
        ("BOOKS_INTERVAL", "200ms".to_owned()),
        ("BOOKS_GRACE", "100ms".to_owned()),
    ];
    let vars: Vec<(&str, &str)> = vars.iter().map(|(name, value)| (*name, value.as_str())).collect();
    shop.kill(Service::Api).await;
    shop.restart_with(Service::Api, &vars).await;

    let job_id = shop.place(&[("SKU-2", 3)]).await;
    let order_id = order_id(&shop.wait_for_state(job_id, "succeeded").await);
    shop.assert_books_balance().await;
    let held = "books_disagreements{kind=\"held_by_ended\"}";
    // A check that ran before inventory settled the reservation (the grace is short) counts it;
    // the next one, after, does not.
    eventually("the books to be checked and agree", WAIT, || async {
        let text = http::request("GET", &format!("{}/metrics", shop.http(Service::Api)), &[], None).await.ok()?;
        let checked = String::from_utf8_lossy(&text.body).contains(held);
        (checked && shop.metric(Service::Api, held).await == 0).then_some(())
    })
    .await;

    // An invoiced order's reservation put back to held, its stock with it: a lost settle.
    settle_by_hand(&shop, order_id, "held", 3).await;
    eventually("the check to count the leak", WAIT, || async {
        (shop.metric(Service::Api, held).await == 1).then_some(())
    })
    .await;
    let output = shop.env.msgctl(&["books", "--grace", "100ms", "--json"]).await;
    assert!(!output.status.success(), "disagreements exit 1: {output:?}");
    let listed: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
        .collect();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["kind"], "held_by_ended");
    assert_eq!(listed[0]["orderId"].as_str(), Some(order_id.to_string().as_str()));
    assert_eq!(listed[0]["status"], "invoiced");

    // A compensation that does not answer (billing is down): counted until it does.
    settle_by_hand(&shop, order_id, "settled", -3).await;
    shop.kill(Service::Billing).await;
    let job_id = shop.place(&[("SKU-2", 1)]).await;
    let cancelled = crate::order_id(&shop.job(job_id).await);
    assert_eq!(cancel(&shop, &cancelled.to_string()).await.0, 202);
    let overdue = "books_disagreements{kind=\"compensation_overdue\"}";
    eventually("the unanswered compensation to be counted", WAIT, || async {
        (shop.metric(Service::Api, overdue).await == 1 && shop.metric(Service::Api, held).await == 0).then_some(())
    })
    .await;
    shop.restart(Service::Billing).await;
    shop.wait_for_state(job_id, "cancelled").await;
    eventually("the books to agree again", WAIT, || async {
        (shop.metric(Service::Api, overdue).await == 0).then_some(())
    })
    .await;
    shop.assert_books_balance().await;
    assert_eq!(shop.metric(Service::Api, "books_check_up").await, 1);

    // Stock reserved outside any reservation: the SKU's reserved is not what its held
    // reservations hold.
    let unconserved = "books_disagreements{kind=\"stock_not_conserved\"}";
    take_by_hand(&shop, 2).await;
    eventually("the unconserved stock to be counted", WAIT, || async {
        (shop.metric(Service::Api, unconserved).await == 1).then_some(())
    })
    .await;
    let output = shop.env.msgctl(&["books", "--grace", "100ms", "--json"]).await;
    let listed: Value = serde_json::from_slice(&output.stdout).expect("one disagreement");
    assert_eq!((listed["kind"].as_str(), listed["sku"].as_str()), (Some("stock_not_conserved"), Some("SKU-5")));
    assert_eq!(listed["status"], "reserved 2, held 0");
    take_by_hand(&shop, -2).await;

    // An order undecided long past its deadline (the deadline lost) that holds stock: billing is
    // down, and the order was placed, by its row, two hours ago.
    shop.kill(Service::Billing).await;
    let job_id = shop.place(&[("SKU-4", 1)]).await;
    let undecided = crate::order_id(&shop.job(job_id).await);
    shop.wait_for_held_stock(undecided).await;
    let past = "books_disagreements{kind=\"held_past_deadline\"}";
    assert_eq!(shop.metric(Service::Api, past).await, 0, "within its deadline");
    sqlx::query("update orders set created_at = now() - interval '2 hours' where id = $1")
        .bind(undecided)
        .execute(&shop.orders)
        .await
        .expect("the order");
    eventually("the order past its deadline to be counted", WAIT, || async {
        (shop.metric(Service::Api, past).await == 1).then_some(())
    })
    .await;
    shop.restart(Service::Billing).await;
    shop.wait_for_state(job_id, "succeeded").await;
    eventually("the books to agree again", WAIT, || async {
        (shop.metric(Service::Api, past).await == 0 && shop.metric(Service::Api, unconserved).await == 0).then_some(())
    })
    .await;

    // The invoiced order's invoice voided and its reservation released, by hand: undos of an
    // order that ended invoiced, each its own disagreement until put back.
    let void = "books_disagreements{kind=\"invoiced_but_void\"}";
    let released = "books_disagreements{kind=\"invoiced_but_released\"}";
    assert_eq!(shop.metric(Service::Api, void).await + shop.metric(Service::Api, released).await, 0);
    let by_hand = |pool: &sqlx::PgPool, sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::query(sql).bind(order_id).execute(&pool).await.expect(sql) }
    };
    by_hand(&shop.billing, "update invoices set state = 'void', voided_at = now() where order_id = $1").await;
    by_hand(&shop.inventory, "update reservations set state = 'released', ended_at = now() where order_id = $1").await;
    eventually("the undone invoiced order to be counted twice", WAIT, || async {
        (shop.metric(Service::Api, void).await == 1 && shop.metric(Service::Api, released).await == 1).then_some(())
    })
    .await;
    let output = shop.env.msgctl(&["books", "--grace", "100ms", "--json"]).await;
    let listed: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
        .collect();
    let kinds: Vec<(&str, &str)> =
        listed.iter().filter_map(|found| Some((found["kind"].as_str()?, found["orderId"].as_str()?))).collect();
    let order = order_id.to_string();
    assert_eq!(kinds, [("invoiced_but_void", order.as_str()), ("invoiced_but_released", order.as_str())]);
    by_hand(&shop.billing, "update invoices set state = 'standing', voided_at = null where order_id = $1").await;
    by_hand(&shop.inventory, "update reservations set state = 'settled' where order_id = $1").await;
    eventually("the books to agree again", WAIT, || async {
        (shop.metric(Service::Api, void).await + shop.metric(Service::Api, released).await == 0).then_some(())
    })
    .await;

    // A check that cannot run says so: books_check_up 0, and no stale figures.
    shop.kill(Service::Api).await;
    let unreachable = format!("{}_no_such_database", shop.env.database_url("inventory"));
    let vars: Vec<(&str, &str)> = vars
        .iter()
        .map(|(name, value)| (*name, if *name == "BOOKS_INVENTORY_URL" { unreachable.as_str() } else { *value }))
        .collect();
    shop.restart_with(Service::Api, &vars).await;
    eventually("the failed check to be reported", WAIT, || async {
        let text = http::request("GET", &format!("{}/metrics", shop.http(Service::Api)), &[], None).await.ok()?;
        let text = String::from_utf8_lossy(&text.body).into_owned();
        (text.lines().any(|line| line == "books_check_up 0") && !text.contains("books_disagreements{")).then_some(())
    })
    .await;
}
