//! A server that cannot work now (out of disk, memory or connections: SQLSTATE class 53) is an
//! outage, not the message's fault (decision 0003, amended by issue 56, row 4): the consumers hold
//! their deliveries without spending an attempt for longer than the whole retry ladder, the API
//! answers 503 with `Retry-After`, and once the server works again every order completes on its
//! first attempt, with nothing parked.
//!
//! The states are raised by the real server, from triggers on the tables the services write (a
//! disk that fills under the inventory's reservations, memory that runs out under the orders'
//! table), so that the services meet them exactly where a full disk would stop them.

use std::time::Duration;

use messaging::runtime::metrics::DELIVERIES_HELD;
use testkit::{
    eventually,
    shop::{Options, Service, Shop, WAIT},
};

/// Make every insert into `table` fail with SQLSTATE `code`, or (`None`) stop it.
async fn refuse_inserts(pool: &sqlx::PgPool, table: &str, code: Option<&str>) {
    let statements = match code {
        Some(code) => vec![
            format!(
                "create function refuse_{table}() returns trigger language plpgsql as \
                 $$ begin raise exception 'the server cannot now' using errcode = '{code}'; end $$"
            ),
            format!("create trigger refuse before insert on {table} for each row execute function refuse_{table}()"),
        ],
        None => vec![format!("drop trigger refuse on {table}"), format!("drop function refuse_{table}()")],
    };
    for statement in statements {
        // Identifiers and codes written in this file, never input.
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(pool).await.expect("the trigger");
    }
}

#[tokio::test]
async fn a_full_disk_holds_deliveries_without_spending_attempts_and_the_api_answers_503() {
    // Five attempts 100 ms and 300 ms apart: the whole ladder is spent in about a second.
    let mut shop = Shop::start(Options::default()).await;
    refuse_inserts(&shop.inventory, "reservations", Some("53100")).await;
    let job = shop.place(&[("SKU-2", 1)]).await;
    eventually("inventory to hold the order's delivery", WAIT, || async {
        (shop.metric(Service::Inventory, DELIVERIES_HELD).await >= 1).then_some(())
    })
    .await;

    // Four times the ladder: held all along, not retried, not parked.
    let window = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < window {
        let state = shop.job(job).await;
        // `queued` until the relay's mark commits, which can come after inventory holds the
        // delivery; never `retry_wait` or `quarantined`.
        let waiting = matches!(state["state"].as_str(), Some("queued" | "published"));
        assert!(waiting, "a full disk spends no attempt: {state}");
        assert_eq!(state["attempt"], 1, "{state}");
        assert!(shop.metric(Service::Inventory, DELIVERIES_HELD).await >= 1, "held until the disk has room");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // The orders database out of memory: the API refuses for now, and says when to come back.
    refuse_inserts(&shop.orders, "orders", Some("53200")).await;
    let refused = shop.try_place(&[("SKU-2", 1)]).await.expect("POST /orders");
    assert_eq!(refused.status, 503, "{}", String::from_utf8_lossy(&refused.body));
    assert!(refused.header("retry-after").is_some(), "a 503 says when to retry");
    // Counted for the API's 5xx alert (`/readyz` stays 200: the database answers reads).
    assert!(shop.metric(Service::Api, "http_responses_total{class=\"5xx\"}").await >= 1);

    refuse_inserts(&shop.orders, "orders", None).await;
    refuse_inserts(&shop.inventory, "reservations", None).await;
    let later = shop.place(&[("SKU-3", 1)]).await;
    for job in [job, later] {
        let done = shop.wait_for_state(job, "succeeded").await;
        assert_eq!(done["attempt"], 1, "no attempt spent on the outage: {done}");
    }
    assert_eq!(shop.metric(Service::Inventory, DELIVERIES_HELD).await, 0);
    shop.assert_books_balance().await;
}
