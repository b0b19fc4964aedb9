//! Outbox rows the broker will never take, ahead of a thousand orders it will: an order whose
//! `order.placed` is over the broker's `max_message_size`, and a message for an exchange the
//! relay's broker user may not write. The broker closes the relay's channel for each; the relay
//! finds the row, counts its attempts with the broker's reason, and parks it after
//! `RELAY_MAX_ATTEMPTS`, while the orders behind flow. The order's job ends quarantined with the
//! reason; `msgctl outbox stuck` lists both rows; once the causes are fixed, `msgctl outbox retry`
//! re-arms them and they are published, the order succeeding after all. A third row, first
//! returned as unroutable and then too large, is parked after as many refusals, however often it
//! was returned before: only a refusal counts toward parking.
//!
//! A suite of its own: it lowers the broker's `max_message_size` (a node-wide setting, restored
//! afterwards), and no other test may run beside it on that broker meanwhile.

use lapin::{
    options::{QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
};
use messaging::{contracts::Contract, outbox, topology};
use serde::Serialize;
use testkit::{
    eventually, http, rabbitmqctl_blocking,
    roles::Accounts,
    shop::{Options, Service, Shop, WAIT},
};
use uuid::Uuid;

/// The broker's `max_message_size` for the test: an order of 100 lines (about 3 KB) is over it,
/// the shop's other messages (a few hundred bytes) are well under.
const LIMIT: u32 = 2048;

/// `rabbitmqctl eval EXPRESSION` on the broker under test; what it printed.
fn eval(expression: &str) -> String {
    let output = rabbitmqctl_blocking(&["eval", expression]).output();
    let output = output.unwrap_or_else(|error| panic!("rabbitmqctl eval {expression}: {error}"));
    assert!(output.status.success(), "rabbitmqctl eval {expression}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// The broker's `max_message_size` lowered to [`LIMIT`] while it lives, put back as it was when
/// dropped (a failed test included). RabbitMQ 3.x reads it from the application's environment when
/// a channel opens; 4.x from a `persistent_term` set at boot, at each publish (as its own
/// `message_size_limit_SUITE` changes it), which 3.x does not have: both are set where they exist.
struct LoweredLimit {
    /// What `application:get_env` said before: `{ok,N}` or `undefined`.
    before: String,
    /// What the `persistent_term` held before: a number on 4.x, `undefined` on 3.x.
    term_before: String,
}

impl LoweredLimit {
    fn new() -> Self {
        let before = eval("application:get_env(rabbit, max_message_size).");
        let term_before = eval("persistent_term:get(max_message_size, undefined).");
        eval(&format!("application:set_env(rabbit, max_message_size, {LIMIT})."));
        if term_before != "undefined" {
            eval(&format!("persistent_term:put(max_message_size, {LIMIT})."));
        }
        Self { before, term_before }
    }

    /// Put the limit back now (4.x's term is put back, never erased: each publish reads it).
    fn restore(&self) {
        match self.before.strip_prefix("{ok,").and_then(|rest| rest.strip_suffix('}')) {
            Some(value) => eval(&format!("application:set_env(rabbit, max_message_size, {value}).")),
            None => eval("application:unset_env(rabbit, max_message_size)."),
        };
        if self.term_before != "undefined" {
            eval(&format!("persistent_term:put(max_message_size, {}).", self.term_before));
        }
    }
}

impl Drop for LoweredLimit {
    fn drop(&mut self) {
        self.restore();
    }
}

/// A message of the shop's for an exchange the relay's user may not write (`ops/rabbitmq/users.sh`
/// lets it write the shop's exchanges only).
#[derive(Debug, Serialize)]
struct AuditNoted {
    note: String,
}

impl Contract for AuditNoted {
    const TYPE: &'static str = "audit.noted";
    const EXCHANGE: &'static str = "audit";
}

/// A message for an exchange the relay may write, under a routing key no queue binds (so it is
/// returned), with a body over [`LIMIT`] (so it is refused once the limit is lowered).
#[derive(Debug, Serialize)]
struct BulkyNote {
    note: String,
}

impl Contract for BulkyNote {
    const TYPE: &'static str = "order.noted";
    const EXCHANGE: &'static str = "orders";
}

/// `msgctl outbox ARGS` on the orders database, which must succeed; what it printed.
async fn msgctl_outbox(shop: &Shop, args: &[&str]) -> String {
    let output = shop.env.msgctl(&[&["outbox"], args].concat()).await;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The rows `msgctl outbox stuck --json` lists for the orders database.
async fn stuck(shop: &Shop) -> Vec<serde_json::Value> {
    let listed = msgctl_outbox(shop, &["stuck", "--json"]).await;
    listed.lines().map(|line| serde_json::from_str(line).expect("JSON")).collect()
}

/// Whether the row of `message_id` is parked: its attempts, refusals and last error.
async fn parked(shop: &Shop, message_id: Uuid) -> Option<(i32, i32, String)> {
    sqlx::query_as("select attempts, refusals, last_error from outbox where message_id = $1 and parked_at is not null")
        .bind(message_id)
        .fetch_optional(&shop.orders)
        .await
        .expect("read the outbox")
}

#[tokio::test]
async fn rows_the_broker_refuses_are_parked_with_its_reason_and_the_thousand_orders_behind_them_succeed() {
    let relay_env = [("RELAY_MAX_ATTEMPTS", "3"), ("RELAY_RETRY_INITIAL", "50ms"), ("RELAY_RETRY_MAX", "400ms")];
    let options = Options {
        least_privilege: true,
        relay_env: relay_env.iter().map(|(name, value)| (*name, (*value).to_owned())).collect(),
        ..Options::default()
    };
    let mut shop = Shop::start(options).await;
    shop.restock("SKU-%", 100_000).await;

    // Returned, as unroutable, more times than the relay's attempts: still waiting, not parked.
    let mut tx = shop.orders.begin().await.expect("begin");
    let bulky = outbox::enqueue(&mut tx, &BulkyNote { note: "x".repeat(LIMIT as usize) }, None).await.expect("enqueue");
    tx.commit().await.expect("commit");
    eventually("the bulky row to be returned four times", WAIT, || async {
        let attempts: i32 =
            sqlx::query_scalar("select attempts from outbox where message_id = $1 and parked_at is null")
                .bind(bulky)
                .fetch_one(&shop.orders)
                .await
                .expect("read the outbox");
        (attempts >= 4).then_some(())
    })
    .await;
    let limit = LoweredLimit::new();
    // A channel takes the limit when it opens: on the relay's open one, the order below could go
    // out under the old limit (CI saw it once). A relay started now opens its channels under it.
    shop.kill(Service::Relay).await;
    shop.restart(Service::Relay).await;

    // Over the broker's limit: an order of 100 lines.
    let big = shop.place(&[("SKU-1", 1); 100]).await;
    // For an exchange that exists (the deploy step declares every exchange) and the relay may not
    // write: a row written as a service would write it. (A missing exchange is held, not refused:
    // `tests/topology.rs`.)
    let connection = shop.env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    topology::declare_exchanges(&channel, &[AuditNoted::EXCHANGE]).await.expect("the audit exchange");
    let _ = connection.close(200, "bye".into()).await;
    let mut tx = shop.orders.begin().await.expect("begin");
    let audit = outbox::enqueue(&mut tx, &AuditNoted { note: "refused".into() }, None).await.expect("enqueue");
    tx.commit().await.expect("commit");
    // A thousand ordinary orders behind them.
    let skus = ["SKU-1", "SKU-2", "SKU-3"];
    let mut ordinary = Vec::new();
    for i in 0..1000 {
        ordinary.push(shop.place(&[(skus[i % 3], 1)]).await);
    }

    // Each refused row is parked after its three refusals, with the broker's reason; the bulky
    // row's returns before the limit was lowered do not count toward it.
    let big_row = big_message(&shop, big).await;
    let (attempts, refusals, reason) =
        eventually("the order's row to be parked", WAIT, || parked(&shop, big_row)).await;
    assert_eq!((attempts, refusals), (3, 3));
    assert!(reason.contains("PRECONDITION_FAILED") && reason.contains("max size"), "{reason}");
    let (attempts, refusals, reason) = eventually("the audit row to be parked", WAIT, || parked(&shop, audit)).await;
    assert_eq!((attempts, refusals), (3, 3));
    assert!(reason.contains("ACCESS_REFUSED"), "{reason}");
    let (attempts, refusals, reason) = eventually("the bulky row to be parked", WAIT, || parked(&shop, bulky)).await;
    assert!(attempts >= 7 && refusals == 3, "attempts {attempts}, refusals {refusals}");
    assert!(reason.contains("max size"), "{reason}");
    // Its job ends quarantined with the reason, and the thousand orders behind succeed.
    let job = shop.wait_for_state(big, "quarantined").await;
    assert!(job["lastError"].as_str().is_some_and(|error| error.contains("max size")), "{job}");
    for job in &ordinary {
        shop.wait_for_state(*job, "succeeded").await;
    }
    // Seen by the operator: the parked gauge (the alert's), and msgctl.
    let gauge = format!("outbox_rows{{database=\"t_{}_orders\",state=\"parked\"}}", shop.env.id());
    assert_eq!(shop.metric(Service::Relay, &gauge).await, 3);
    let listed = stuck(&shop).await;
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(listed.iter().all(|row| row["state"] == "parked"), "{listed:?}");

    // The causes fixed: the broker's limit back, the relay allowed the audit exchange, and both
    // notes' routes given a queue.
    limit.restore();
    let accounts = Accounts::of(&shop.env);
    let user = accounts.broker_user(Service::Relay);
    let permissions = format!("/api/permissions/{}/{user}", shop.env.vhost());
    let url = http::join(shop.env.management_url(), &permissions);
    // `audit` added to what users.sh gave, which must stay: RabbitMQ 4.3 answers the relay's
    // lookup of a work queue only because it may write to its name (replaced by the shared
    // exchanges alone, every lookup after was refused and the relay's session ended each time).
    let current = http::request("GET", &url, &[], None).await.expect("the relay's permissions");
    let current: serde_json::Value = serde_json::from_slice(&current.body).expect("permissions as JSON");
    let write = current["write"].as_str().expect("a write pattern");
    let allowed = serde_json::json!({
        "configure": current["configure"], "write": format!("^audit$|{write}"), "read": current["read"],
    })
    .to_string();
    let granted = http::request("PUT", &url, &[("content-type", "application/json")], Some(&allowed)).await;
    assert!(granted.is_ok_and(|response| response.status < 300), "grant the relay the audit exchange");
    probe_queue(&shop, AUDIT_QUEUE, AuditNoted::EXCHANGE, AuditNoted::TYPE).await;
    probe_queue(&shop, BULKY_QUEUE, BulkyNote::EXCHANGE, BulkyNote::TYPE).await;

    msgctl_outbox(&shop, &["retry", "--all"]).await;
    shop.wait_for_state(big, "succeeded").await;
    for queue in [AUDIT_QUEUE, BULKY_QUEUE] {
        eventually("the notes to be delivered", WAIT, || async {
            (shop.env.queue_depth(queue).await == Some(1)).then_some(())
        })
        .await;
    }
    assert!(stuck(&shop).await.is_empty());
    shop.assert_books_balance().await;
}

/// The queues standing in for an audit service, and for whatever reads the bulky notes.
const AUDIT_QUEUE: &str = "audit.probe";
const BULKY_QUEUE: &str = "noted.probe";

/// Declare `queue`, bound to `exchange` by `key`.
async fn probe_queue(shop: &Shop, queue: &str, exchange: &str, key: &str) {
    let connection = shop.env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    topology::declare_exchanges(&channel, &[exchange]).await.expect("exchange");
    let declare = QueueDeclareOptions::durable();
    channel.queue_declare(queue.into(), declare, FieldTable::default()).await.expect("queue");
    let bind = QueueBindOptions::default();
    channel.queue_bind(queue.into(), exchange.into(), key.into(), bind, FieldTable::default()).await.expect("bind");
    let _ = connection.close(200, "bye".into()).await;
}

/// The message id of the job's `order.placed`.
async fn big_message(shop: &Shop, job_id: Uuid) -> Uuid {
    sqlx::query_scalar("select order_placed_message_id from jobs where id = $1")
        .bind(job_id)
        .fetch_one(&shop.orders)
        .await
        .expect("the job's order.placed")
}
