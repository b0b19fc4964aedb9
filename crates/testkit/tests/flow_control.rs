//! Broker flow control, for real: a memory alarm (`set_vm_memory_high_watermark`) and a disk alarm
//! (`set_disk_free_limit`), each held for longer than every timeout, while the inventory worker
//! starts into a queue of orders, a tenth of them FLAKY (their retries need a publish).
//!
//! RabbitMQ stops reading from a connection once it publishes during an alarm. The worker
//! publishes over a connection of its own, so its consuming connection keeps acking: it applies
//! the orders that need no publish while the alarm lasts, and holds the FLAKY ones, which go back
//! unacked when their confirm is overdue (`CONFIRM_TIMEOUT`). `/readyz` names the blocked
//! connections, and `broker_connection_blocked_seconds` says for how long. Once the alarm clears,
//! every job ends and the books balance.
//!
//! A suite of its own, its tests one at a time: an alarm is the whole node's.

use std::time::Duration;

use testkit::{
    eventually, http, rabbitmqctl_blocking,
    shop::{Options, Service, Shop, WAIT},
};

/// How long the alarm is held: several times every timeout below.
const ALARM: Duration = Duration::from_secs(20);

/// The services' `CONFIRM_TIMEOUT` here.
const CONFIRM_TIMEOUT: &str = "3s";

/// The orders queued before the worker starts; every tenth is FLAKY.
const ORDERS: usize = 200;

/// The consumers' `PREFETCH`: the default.
const PREFETCH: u16 = 64;

/// One alarm at a time on the node.
static NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `rabbitmqctl ARGS` on the broker under test; what it printed.
fn ctl(args: &[&str]) -> String {
    let output = rabbitmqctl_blocking(args).output();
    let output = output.unwrap_or_else(|error| panic!("rabbitmqctl {}: {error}", args.join(" ")));
    assert!(output.status.success(), "rabbitmqctl {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// A resource alarm: how to raise it, and how to put the node back as it was.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Memory,
    Disk,
}

/// An alarm raised on the node while it lives, cleared when dropped (a failed test included).
struct Alarm {
    /// The command that restores the watermark as it was.
    restore: Vec<String>,
}

impl Alarm {
    fn raise(kind: Kind) -> Self {
        let restore = match kind {
            Kind::Memory => {
                let before = ctl(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."]);
                ctl(&["set_vm_memory_high_watermark", "0.0000001"]);
                vec!["eval".to_owned(), format!("vm_memory_monitor:set_vm_memory_high_watermark({before}).")]
            }
            Kind::Disk => {
                let before = ctl(&["eval", "rabbit_disk_monitor:get_disk_free_limit()."]);
                ctl(&["set_disk_free_limit", "100000GB"]);
                vec!["set_disk_free_limit".to_owned(), before]
            }
        };
        Self { restore }
    }

    fn clear(&self) {
        let args: Vec<&str> = self.restore.iter().map(String::as_str).collect();
        ctl(&args);
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Whether the node has a resource alarm in effect.
fn alarmed() -> bool {
    ctl(&["eval", "rabbit_alarm:get_alarms()."]) != "[]"
}

/// The blocked connections `/readyz` names.
async fn blocked(shop: &Shop, service: Service) -> Vec<String> {
    let Ok(response) = shop.readyz(service).await else { return Vec::new() };
    let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap_or_default();
    body["blockedConnections"].as_object().map(|blocked| blocked.keys().cloned().collect()).unwrap_or_default()
}

/// How many connections the relay has open on the broker: one per outbox database, unless it
/// opened new ones beside those the broker blocks.
async fn relay_connections(shop: &Shop) -> usize {
    let path = format!("/api/vhosts/{}/connections", shop.env.vhost());
    let url = http::join(shop.env.management_url(), &path);
    let response = http::request("GET", &url, &[], None).await.expect("the management API answers");
    let body: serde_json::Value = serde_json::from_slice(&response.body).expect("a JSON list of connections");
    let names = body.as_array().expect("a list").iter().map(|c| c["client_properties"]["connection_name"].as_str());
    names.filter(|name| name.is_some_and(|name| name.starts_with("relay:"))).count()
}

async fn count(pool: &sqlx::PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

async fn ride_out(kind: Kind) {
    let _node = NODE.lock().await;
    let timeout = vec![("CONFIRM_TIMEOUT", CONFIRM_TIMEOUT.to_owned())];
    // The default prefetch: held deliveries keep their place in the window until their confirm is
    // overdue, so a window smaller than the FLAKY orders it meets in CONFIRM_TIMEOUT fills.
    let options = Options {
        demo_faults: true,
        prefetch: PREFETCH,
        consumer_env: timeout.clone(),
        relay_env: timeout,
        ..Options::default()
    };
    let mut shop = Shop::start(options).await;
    shop.restock("SKU-1", 100_000).await;

    // The orders wait in inventory's queue, the worker stopped.
    shop.kill(Service::Inventory).await;
    for i in 0..ORDERS {
        let sku = if i % 10 == 9 { "FLAKY-1" } else { "SKU-1" };
        shop.place(&[(sku, 1)]).await;
    }
    eventually("every order.placed to be published", WAIT, || async {
        (count(&shop.orders, "select count(*) from outbox where published_at is null and not scheduled").await == 0)
            .then_some(())
    })
    .await;

    let alarm = Alarm::raise(kind);
    eventually("the alarm to be in effect", WAIT, || async { alarmed().then_some(()) }).await;
    let raised = tokio::time::Instant::now();
    shop.restart(Service::Inventory).await;

    // The relay publishes what inventory writes, and is blocked: /readyz and the gauge say so.
    let name = eventually("the relay's connection to be reported blocked", WAIT, || async {
        blocked(&shop, Service::Relay).await.into_iter().next()
    })
    .await;
    let gauge = format!("broker_connection_blocked_seconds{{connection=\"{name}\"}}");
    eventually("the blocked gauge to count", WAIT, || async {
        (shop.metric_value(Service::Relay, &gauge).await > 0.0).then_some(())
    })
    .await;

    // The alarm held past every timeout; then, while it still holds, the worker goes on applying
    // the orders that need no publish until nine in ten are (not in a fixed time: how many one
    // session applies before its held FLAKY deliveries fill the window depends on the machine).
    tokio::time::sleep_until(raised + ALARM).await;
    let ordinary = (ORDERS - ORDERS / 10) as i64;
    let applied =
        eventually("nine in ten of the orders that need no publish applied during the alarm", WAIT, || async {
            let applied = count(&shop.inventory, "select count(*) from reservations").await;
            assert!(
                alarmed(),
                "{kind:?} alarm: it cleared before the worker had applied 9 in 10 ({applied} of {ordinary})"
            );
            (applied * 10 >= ordinary * 9).then_some(applied)
        })
        .await;
    println!("{kind:?} alarm: {applied} of the {ordinary} orders that need no publish applied while it lasted");
    // The relay's blocked sessions ended on their overdue confirms, several times over: each
    // waited for its connection to be unblocked rather than opening another to be blocked too.
    let connections = relay_connections(&shop).await;
    assert!(connections <= 3, "{kind:?} alarm: the relay holds {connections} connections for its 3 databases");

    drop(alarm);
    eventually("the alarm to clear", WAIT, || async { (!alarmed()).then_some(()) }).await;
    eventually("the relay's connection to be reported unblocked", WAIT, || async {
        blocked(&shop, Service::Relay).await.is_empty().then_some(())
    })
    .await;
    // Every job ends (the FLAKY ones after their retries) and the books balance.
    shop.assert_books_balance().await;
}

#[tokio::test]
async fn a_memory_alarm_blocks_publishing_but_not_the_acks_of_what_needs_no_publish() {
    ride_out(Kind::Memory).await;
}

#[tokio::test]
async fn a_disk_alarm_blocks_publishing_but_not_the_acks_of_what_needs_no_publish() {
    ride_out(Kind::Disk).await;
}
