//! Two instances of every service, as a team runs them behind a load balancer: the two APIs share
//! one front port and one database (an Idempotency-Key holds across them), two relays drain the
//! same outboxes, and two consumers share each queue. Killing one instance of each mid-burst
//! loses nothing and applies nothing twice.

use std::time::Duration;

use testkit::{
    eventually, http,
    shop::{Instance, Options, Service, Shop, WAIT},
};

/// One shop of two instances at a time: with every pool full, two of them take about 100 of the
/// server's connections, and a Postgres left at its default `max_connections` (100, the machine's
/// own) refused the rest (seen in CI: the ledger's queries timing out for a connection).
static ONE_SHOP: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn second(service: Service) -> Instance {
    Instance { service, index: 1 }
}

/// The same key sent to each API while the first holds it uncommitted: the second waits for the
/// first's commit and answers with the same job; one order is written. The second writes with
/// group commit and the first without, as during a change of `ORDER_GROUP_COMMIT`.
#[tokio::test]
async fn an_idempotency_key_holds_across_two_apis() {
    let _one = ONE_SHOP.lock().await;
    let mut shop = Shop::start(Options { instances: 2, ..Options::default() }).await;
    shop.kill(Service::Api).await;
    shop.restart_with(Service::Api, &[("FAILPOINTS", "api.before-commit=1s")]).await;
    shop.kill(second(Service::Api)).await;
    shop.restart_with(second(Service::Api), &[("ORDER_GROUP_COMMIT", "true")]).await;
    let body = r#"{"customerId":"twice","lines":[{"sku":"SKU-1","quantity":1}]}"#;
    let post = |base: String| {
        tokio::spawn(async move {
            let operator = testkit::auth::bearer(&testkit::auth::operator());
            let headers = [("Idempotency-Key", "across-instances"), ("Authorization", &operator)];
            http::request("POST", &format!("{base}/orders"), &headers, Some(body)).await.expect("POST /orders")
        })
    };
    let first = post(shop.http(Service::Api).to_owned());
    // The first API holds the key in its open transaction before the second is asked.
    shop.wait_for_failpoint(Service::Api, orders_api::place::BEFORE_COMMIT, 1).await;
    let second = post(shop.http(second(Service::Api)).to_owned());
    let (first, second) = (first.await.expect("task"), second.await.expect("task"));
    let job = |response: &http::Response| {
        assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
        response.json()["jobId"].as_str().expect("jobId").to_owned()
    };
    assert_eq!(job(&first), job(&second), "one key, one job, whichever API answers");
    let orders: i64 = sqlx::query_scalar("select count(*) from orders where customer_id = 'twice'")
        .fetch_one(&shop.orders)
        .await
        .expect("count orders");
    assert_eq!(orders, 1);
    shop.accepted.push(job(&first).parse().expect("a job id"));
    shop.assert_books_balance().await;
}

#[tokio::test]
async fn two_of_each_share_the_work_and_one_of_each_may_die() {
    let _one = ONE_SHOP.lock().await;
    let mut shop = Shop::start(Options { instances: 2, ..Options::default() }).await;
    assert_eq!(shop.instances().len(), 8);
    assert_ne!(shop.front(), shop.http(Service::Api), "the APIs are behind a balancer");

    // Both consumers of each queue take deliveries (the broker hands them out in turn).
    shop.place_burst(40).await;
    shop.assert_books_balance().await;
    for worker in [Service::Inventory, Service::Billing] {
        for instance in [worker.into(), second(worker)] {
            let handled = shop.metric(instance, "messages_handled_total").await;
            assert!(handled > 0, "{instance} handled {handled} messages of 40 orders' worth");
        }
    }

    // One instance of each dies mid-burst and stays down: the other carries on, behind the
    // same front port.
    let burst = tokio::time::timeout(WAIT, async {
        let mut placed = 0;
        for service in Service::ALL {
            placed += shop.place_burst(10).await.len();
            shop.kill(service).await;
        }
        placed + shop.place_burst(20).await.len()
    });
    assert_eq!(burst.await.expect("the burst is placed in time"), 60);
    shop.settle(WAIT).await;
    for service in Service::ALL {
        shop.restart(service).await;
    }
    shop.assert_books_balance().await;

    // Both are consuming again once restarted.
    for worker in [Service::Inventory, Service::Billing] {
        let before = shop.metric(worker, "messages_handled_total").await;
        shop.place_burst(20).await;
        eventually(&format!("the restarted {worker:?} to take deliveries"), Duration::from_secs(30), || async {
            (shop.metric(worker, "messages_handled_total").await > before).then_some(())
        })
        .await;
    }
    shop.assert_books_balance().await;
}
