//! The HTTP contract of orders-api: precise problem+json errors that write nothing, idempotency
//! keys, and the all-or-nothing order transaction.

mod common;

use clap::Parser;
use common::{Shop, count};
use testkit::http;
use testkit::shop::Service;

/// Every table an accepted order would touch, in every database, is still empty.
async fn assert_nothing_written(shop: &Shop) {
    for table in ["orders", "order_lines", "jobs", "outbox", "idempotency_keys", "inbox"] {
        assert_eq!(count(&shop.orders, &format!("select count(*) from {table}")).await, 0, "orders.{table}");
    }
    for table in ["reservations", "outbox", "inbox"] {
        assert_eq!(count(&shop.inventory, &format!("select count(*) from {table}")).await, 0, "inventory.{table}");
    }
    for table in ["invoices", "outbox", "inbox"] {
        assert_eq!(count(&shop.billing, &format!("select count(*) from {table}")).await, 0, "billing.{table}");
    }
}

fn assert_problem(response: &http::Response, status: u16, detail_contains: &str) {
    assert_eq!(response.status, status, "{}", String::from_utf8_lossy(&response.body));
    assert_eq!(response.header("content-type"), Some("application/problem+json"));
    let problem = response.json();
    assert_eq!(problem["status"], status);
    let detail = problem["detail"].as_str().expect("detail");
    assert!(detail.contains(detail_contains), "detail `{detail}` should mention `{detail_contains}`");
}

#[tokio::test]
async fn every_bad_input_gets_its_problem_and_writes_nothing() {
    let shop = common::start().await;
    let line = r#"{"sku":"SKU-1","quantity":1}"#;
    let many_lines = vec![line; 101].join(",");
    let huge = format!(r#"{{"customerId":"{}","lines":[{line}]}}"#, "x".repeat(70 * 1024));
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("malformed JSON", r#"{"customerId":"c","lines":["#.into(), 400, "invalid JSON"),
        (
            "unknown field",
            format!(r#"{{"customerId":"c","lines":[{line}],"coupon":"X"}}"#),
            400,
            "unknown field `coupon`",
        ),
        (
            "unknown line field",
            r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":1,"price":1}]}"#.into(),
            400,
            "unknown field `price`",
        ),
        ("missing customer", format!(r#"{{"lines":[{line}]}}"#), 400, "missing field `customerId`"),
        ("no lines", r#"{"customerId":"c","lines":[]}"#.into(), 400, "lines must not be empty"),
        (
            "quantity 0",
            r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":0}]}"#.into(),
            400,
            "quantity must be between 1 and 1000, got 0",
        ),
        ("quantity 1001", r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":1001}]}"#.into(), 400, "got 1001"),
        ("101 lines", format!(r#"{{"customerId":"c","lines":[{many_lines}]}}"#), 400, "at most 100 lines"),
        ("wrong type", r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":"2"}]}"#.into(), 400, "invalid type"),
        ("quantity 2.5", r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":2.5}]}"#.into(), 400, "whole number"),
        (
            "NUL in the customer id",
            r#"{"customerId":"c\u0000d","lines":[{"sku":"SKU-1","quantity":1}]}"#.into(),
            400,
            "customerId must be 1 to 200 characters, not all blank, no control characters",
        ),
        ("blank SKU", r#"{"customerId":"c","lines":[{"sku":"  ","quantity":1}]}"#.into(), 400, "lines[0].sku must be"),
        ("too large", huge, 413, "exceeds 65536 bytes"),
    ];
    for (name, body, status, detail) in &cases {
        let response = shop.post_order(body, &[]).await;
        assert_problem(&response, *status, detail);
        println!("ok: {name}");
    }
    let response = shop.post_order(r#"{"customerId":"c","lines":[]}"#, &[("Content-Type", "text/plain")]).await;
    assert_problem(&response, 415, "application/json");
    let response =
        shop.post_order(&format!(r#"{{"customerId":"c","lines":[{line}]}}"#), &[("Idempotency-Key", "")]).await;
    assert_problem(&response, 400, "Idempotency-Key");

    let get = |path: String| {
        let url = format!("{}{path}", shop.http(Service::Api));
        async move { http::request("GET", &url, &[], None).await.expect("GET") }
    };
    assert_problem(&get("/jobs/not-a-uuid".into()).await, 400, "malformed job id");
    assert_problem(&get("/orders/12345".into()).await, 400, "malformed order id");
    assert_problem(&get(format!("/jobs/{}", uuid::Uuid::new_v4())).await, 404, "no job");
    assert_problem(&get(format!("/orders/{}", uuid::Uuid::new_v4())).await, 404, "no order");
    assert_problem(&get("/nowhere".into()).await, 404, "no such resource");

    assert_nothing_written(&shop).await;
    shop.stop().await;
}

#[tokio::test]
async fn idempotency_key_replays_the_same_job_and_refuses_another_body() {
    let shop = common::start().await;
    let body = r#"{"customerId":"c-7","lines":[{"sku":"SKU-1","quantity":2}]}"#;
    // The same request, formatted differently: still the same request.
    let same = r#"{ "lines": [ { "quantity": 2, "sku": "SKU-1" } ], "customerId": "c-7" }"#;
    let first = shop.post_order(body, &[("Idempotency-Key", "key-1")]).await;
    assert_eq!(first.status, 202);
    let replay = shop.post_order(same, &[("Idempotency-Key", "key-1")]).await;
    assert_eq!(replay.status, 202);
    assert_eq!(replay.json(), first.json(), "same jobId and orderId");
    assert_eq!(replay.header("location"), first.header("location"));

    let other = shop
        .post_order(r#"{"customerId":"c-7","lines":[{"sku":"SKU-1","quantity":3}]}"#, &[("Idempotency-Key", "key-1")])
        .await;
    assert_problem(&other, 422, "Idempotency-Key");

    // Concurrent requests with one new key: exactly one order, one job id for all.
    let mut racers = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let url = format!("{}/orders", shop.http(Service::Api));
        racers.spawn(async move { http::request("POST", &url, &[("Idempotency-Key", "key-race")], Some(body)).await });
    }
    let mut job_ids = std::collections::HashSet::new();
    while let Some(answer) = racers.join_next().await {
        let answer = answer.expect("task").expect("POST /orders");
        assert_eq!(answer.status, 202);
        job_ids.insert(answer.json()["jobId"].as_str().expect("jobId").to_owned());
    }
    assert_eq!(job_ids.len(), 1, "one job for one key");

    let a = shop.post_order(body, &[]).await.json();
    let b = shop.post_order(body, &[]).await.json();
    assert_ne!(a["jobId"], b["jobId"], "no key: a new job each time");
    assert_eq!(count(&shop.orders, "select count(*) from orders").await, 4);
    assert_eq!(count(&shop.orders, "select count(*) from outbox").await, 4);
    shop.stop().await;
}

#[tokio::test]
async fn failure_after_order_insert_before_commit_leaves_no_order_and_no_outbox_row() {
    let shop = common::start().await;
    // Make the outbox insert (the last write of the transaction) fail, after the order, its
    // lines and its job were inserted.
    sqlx::query("alter table outbox add constraint refuse_orders check (message_type <> 'order.placed') not valid")
        .execute(&shop.orders)
        .await
        .expect("constraint");
    let response = shop.post_order(r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":1}]}"#, &[]).await;
    assert_problem(&response, 500, "internal error");
    assert!(!String::from_utf8_lossy(&response.body).contains("refuse_orders"), "no database text leaks");
    assert_nothing_written(&shop).await;
    shop.stop().await;
}

/// Orders that arrive while the API's writers are busy share one statement (group commit,
/// `orders_api::writer`), and each keeps the outcome it would have had alone: a key is claimed
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
    shop.restart_with(Service::Api, &[("FAILPOINTS", "api.before-commit=1s")]).await;
    let url = format!("{}/orders", shop.http(Service::Api));
    let post = |key: Option<String>, customer: &str| {
        let (url, body) =
            (url.clone(), format!(r#"{{"customerId":"{customer}","lines":[{{"sku":"SKU-1","quantity":1}}]}}"#));
        tokio::spawn(async move {
            let headers: Vec<(&str, &str)> = key.iter().map(|key| ("Idempotency-Key", key.as_str())).collect();
            http::request("POST", &url, &headers, Some(&body)).await.expect("POST /orders")
        })
    };
    // Keep every writer busy (each pauses 1 s before its statement), so that what follows queues
    // and is taken as one batch.
    let writers = orders_api::Config::try_parse_from(["orders-api"]).expect("defaults").order_writers;
    let mut blockers = Vec::new();
    for i in 0..writers {
        // One at a time, so that each writer takes one.
        blockers.push(post(None, &format!("blocker-{i}")));
        shop.wait_for_log(Service::Api, "FAILPOINT api.before-commit pausing", usize::from(i) + 1).await;
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
    shop.wait_for_log(Service::Api, "a batch of orders failed; writing each alone", 1).await;

    let written = usize::from(writers) + 24 + 4 + 3 + 1;
    assert_eq!(accepted.len(), written);
    for (table, rows) in [("orders", written), ("order_lines", written), ("jobs", written), ("outbox", written)] {
        assert_eq!(count(&shop.orders, &format!("select count(*) from {table}")).await, rows as i64, "{table}");
    }
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
