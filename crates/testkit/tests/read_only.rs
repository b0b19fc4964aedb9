//! A failover's read-only node: the services reach a database that refuses writes (SQLSTATE
//! 25006, `read_only_sql_transaction`), as they do when a failover leaves them on a demoted
//! primary or on a standby behind a stale address. That is an outage, not the message's fault:
//! the API answers 503 with `Retry-After`, the consumers hold their deliveries without spending an
//! attempt, and once writes are taken again everything completes, with nothing quarantined, lost
//! or applied twice.
//!
//! Made for real on the test's databases: `default_transaction_read_only` set on each, and every
//! session ended (as a failover ends them), so that each service reconnects into read-only
//! sessions. When writes come back, those sessions stay read-only: the services must notice and
//! reconnect by themselves (`messaging::outage::retire_connections`), as they must when a
//! failover leaves them on the old primary.

use std::time::Duration;

use testkit::shop::{Options, Shop};

const DATABASES: [&str; 3] = ["orders", "inventory", "billing"];

/// How long the databases refuse writes.
const READ_ONLY_FOR: Duration = Duration::from_secs(10);

/// Each of the shop's databases refuses writes from now on (`on`) or takes them again (`off`,
/// leaving the sessions opened meanwhile read-only, as a failover back would).
async fn read_only(shop: &Shop, on: bool) {
    for service in DATABASES {
        shop.env.read_only(service, on).await;
    }
}

#[tokio::test]
async fn a_database_that_refuses_writes_for_ten_seconds_mid_load_is_an_outage_not_a_failure() {
    let mut shop = Shop::start(Options::default()).await;
    shop.place_burst(20).await;

    // Orders keep coming (about 20 a second) while the databases refuse writes, and after.
    let start = tokio::time::Instant::now();
    let (switch_on, switch_off, end) =
        (Duration::from_secs(2), Duration::from_secs(2) + READ_ONLY_FOR, Duration::from_secs(20));
    let (mut on, mut off) = (false, false);
    let (mut refused, mut accepted_while_read_only) = (0, 0);
    while start.elapsed() < end {
        if !on && start.elapsed() >= switch_on {
            read_only(&shop, true).await;
            on = true;
        }
        if on && !off && start.elapsed() >= switch_off {
            read_only(&shop, false).await;
            off = true;
        }
        let response = shop.try_place(&[("SKU-1", 1), ("SKU-2", 1)]).await.expect("the API answers");
        match response.status {
            202 if on && !off => accepted_while_read_only += 1,
            202 => {}
            503 => {
                assert!(response.header("retry-after").is_some(), "a 503 says when to retry");
                refused += 1;
            }
            status => panic!("POST /orders answered {status}: {}", String::from_utf8_lossy(&response.body)),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(off, "the databases take writes again");
    // Sessions opened before the switch and not yet ended may take an order or two at first.
    assert!(
        refused >= 10,
        "the API refused orders while its database was read-only ({refused} refused, {accepted_while_read_only} accepted)"
    );

    // Everything completes: every accepted order succeeded or was rejected (none quarantined),
    // nothing lost, stuck or applied twice, stock conserved, one invoice per success.
    let ledger = shop.assert_books_balance().await;
    assert_eq!(ledger.quarantined, 0, "{ledger}");
    // And the API takes orders again on its own, its read-only sessions replaced.
    let job = shop.place(&[("SKU-3", 1)]).await;
    shop.wait_for_state(job, "succeeded").await;
}
