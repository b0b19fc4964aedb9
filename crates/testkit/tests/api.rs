//! The HTTP contract of orders-api where it needs the real processes: with group commit, orders
//! that share one statement under load, each with its own outcome. The rest of the contract
//! (problem documents, idempotency keys, the all-or-nothing write) is tested at the router,
//! without a server or a broker: `crates/orders-api/tests/router.rs`.

mod common;

use clap::Parser;
use common::count;
use testkit::http;
use testkit::shop::Service;

fn assert_problem(response: &http::Response, status: u16, detail_contains: &str) {
    assert_eq!(response.status, status, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.header("content-type"), Some("application/problem+json"));
    let problem = response.json();
    assert_eq!(problem["status"], status);
    let detail = problem["detail"].as_str().expect("detail");
    assert!(detail.contains(detail_contains), "detail `{detail}` should mention `{detail_contains}`");
}

/// With group commit on (`ORDER_GROUP_COMMIT`), orders that arrive while the API's writers are busy
/// share one statement (`orders_api::group_commit`), and each keeps the outcome it would have had
/// alone: a key is claimed
/// once even when both of its requests are in one batch, a different body under a taken key is
/// refused, and an order the database refuses fails alone, its batch written again one by one.
#[tokio::test]
async fn orders_sharing_a_statement_each_keep_their_own_outcome() {
    let mut shop = testkit::shop::Shop::start(testkit::shop::Options::default()).await;
    // The database refuses this customer's orders (and only when they are written).
    sqlx::query("alter table orders add constraint refuse_customer check (customer_id <> 'refused') not valid")
        .execute(&shop.orders)
        .await
        .expect("constraint");
    shop.kill(Service::Api).await;
    shop.restart_with(Service::Api, &[("FAILPOINTS", "api.before-commit=1s"), ("ORDER_GROUP_COMMIT", "true")]).await;
    let url = format!("{}/orders", shop.http(Service::Api));
    let post = |key: Option<String>, customer: &str| {
        let (url, body) =
            (url.clone(), format!(r#"{{"customerId":"{customer}","lines":[{{"sku":"SKU-1","quantity":1}}]}}"#));
        tokio::spawn(async move {
            let operator = testkit::auth::bearer(&testkit::auth::operator());
            let mut headers: Vec<(&str, &str)> = key.iter().map(|key| ("Idempotency-Key", key.as_str())).collect();
            headers.push(("Authorization", &operator));
            http::request("POST", &url, &headers, Some(&body)).await.expect("POST /orders")
        })
    };
    // Keep every writer busy (each pauses 1 s before its statement), so that what follows queues
    // and is taken as one batch.
    let writers = orders_api::Config::try_parse_from([
        "orders-api",
        "--database-url",
        "postgres://localhost/orders",
        "--auth-jwt-key",
        testkit::auth::KEY,
    ])
    .expect("defaults")
    .order_writers;
    let mut blockers = Vec::new();
    for i in 0..writers {
        // One at a time, so that each writer takes one.
        blockers.push(post(None, &format!("blocker-{i}")));
        shop.wait_for_failpoint(Service::Api, orders_api::place::BEFORE_COMMIT, usize::from(i) + 1).await;
    }

    let keyed: Vec<_> = (0..24).map(|i| post(Some(format!("k-{i}")), &format!("c-{i}"))).collect();
    let unkeyed: Vec<_> = (0..4).map(|i| post(None, &format!("u-{i}"))).collect();
    let pairs: Vec<_> =
        (0..3).map(|p| [post(Some(format!("pair-{p}")), "p"), post(Some(format!("pair-{p}")), "p")]).collect();
    let clash = [post(Some("clash".into()), "first"), post(Some("clash".into()), "second")];
    let refused = post(None, "refused");

    let mut accepted = std::collections::HashSet::new();
    let mut accept = |response: http::Response| {
        assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
        let job_id: uuid::Uuid = response.json()["jobId"].as_str().and_then(|id| id.parse().ok()).expect("jobId");
        accepted.insert(job_id);
        job_id
    };
    for answer in blockers.into_iter().chain(keyed).chain(unkeyed) {
        accept(answer.await.expect("task"));
    }
    for [a, b] in pairs {
        let (a, b) = (accept(a.await.expect("task")), accept(b.await.expect("task")));
        assert_eq!(a, b, "one key, one job");
    }
    let mut clash_statuses = Vec::new();
    for answer in clash {
        let response = answer.await.expect("task");
        clash_statuses.push(response.status);
        if response.status == 202 {
            accept(response);
        }
    }
    clash_statuses.sort_unstable();
    assert_eq!(clash_statuses, [202, 422], "the first body under a key is written, the other refused");
    assert_problem(&refused.await.expect("task"), 500, "internal error");
    // The refused order was in a batch with others, which were written again one by one.
    let fell_back = format!(r#"{}{{outcome="fell_back""#, orders_api::group_commit::ORDER_BATCHES);
    assert!(shop.metric(Service::Api, &fell_back).await >= 1, "a batch fell back to writing each order alone");

    let written = usize::from(writers) + 24 + 4 + 3 + 1;
    assert_eq!(accepted.len(), written);
    for (table, rows) in [("orders", written), ("order_lines", written), ("jobs", written)] {
        assert_eq!(count(&shop.orders, &format!("select count(*) from {table}")).await, rows as i64, "{table}");
    }
    // Each order's order.placed, and its scheduled order.deadline unless the order has ended since
    // (the end withdraws it, in the same transaction; and, once invoiced, order.ended).
    let placed = "select count(*) from outbox where message_type = 'order.placed'";
    assert_eq!(count(&shop.orders, placed).await, written as i64, "order.placed");
    // Per job: whether its order.deadline is in the outbox, and whether its order's end is decided.
    let (deadline_or_end, ended_with_a_deadline): (i64, i64) = sqlx::query_as(
        "with job as (
            select exists (select from outbox o where o.message_type = 'order.deadline'
                              and o.payload ->> 'jobId' = j.id::text) as deadline,
                   j.state = any($1) as decided
              from jobs j
         )
         select count(*) filter (where deadline or decided), count(*) filter (where deadline and decided) from job",
    )
    .bind(orders_api::jobs::JobState::DECIDED)
    .fetch_one(&shop.orders)
    .await
    .expect("the jobs' deadlines");
    assert_eq!(deadline_or_end, written as i64, "order.deadline, or an end");
    assert_eq!(ended_with_a_deadline, 0, "an order ended and kept its deadline");
    assert_eq!(count(&shop.orders, "select count(*) from idempotency_keys").await, 24 + 3 + 1);
    let jobs: Vec<uuid::Uuid> = sqlx::query_scalar("select id from jobs").fetch_all(&shop.orders).await.expect("jobs");
    assert_eq!(
        jobs.into_iter().collect::<std::collections::HashSet<_>>(),
        accepted,
        "the jobs written are the ones answered"
    );
    shop.accepted.extend(accepted);
    shop.assert_books_balance().await;
}
