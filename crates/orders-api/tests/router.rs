//! The HTTP contract of orders-api, at the router: every request goes through the API's own
//! router (`orders_api::app`; the service runtime merges the health routes with it) with `tower::ServiceExt::oneshot`, on a migrated database of the
//! test's own, with no server, no broker and no other service. Precise problem+json errors that
//! write nothing, idempotency keys, the all-or-nothing order write, and the lookups. What
//! needs processes (the group commit under a paused writer, crashes) is in `testkit`'s suites. The
//! orders are written as by default, each in a transaction of its own (`orders_api::place`).

use axum::{
    Router,
    body::Body,
    http::{Request, StatusCode, header},
};
use messaging::runtime::metrics::Metrics;
use orders_api::{
    auth::{Auth, AuthArgs},
    group_commit::{BatchMetrics, Writers},
    place::Writer,
};
use serde_json::Value;
use sqlx::PgPool;
use testkit::TestEnv;
use tower::ServiceExt;

/// The test's `MAX_MESSAGE_BYTES`: an order of 100 lines of 40-character SKUs is over it.
const LIMITS: orders_api::api::Limits =
    orders_api::api::Limits { max_message_bytes: 4096, order_deadline: std::time::Duration::from_secs(30 * 60) };

/// The API's router on the test's own `orders` database, writing each order alone (the default).
async fn api(env: &TestEnv) -> (Router, PgPool) {
    api_writing(env, false).await
}

/// [`api`], with group commit (`ORDER_GROUP_COMMIT`) if `grouped`: the rows written are the same.
async fn api_writing(env: &TestEnv, grouped: bool) -> (Router, PgPool) {
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    let writer = if grouped {
        Writer::Grouped(Writers::start(pool.clone(), 2, BatchMetrics::register(&mut Metrics::default())))
    } else {
        Writer::Alone(pool.clone())
    };
    let app = orders_api::app(pool.clone(), writer, LIMITS, auth(), None);
    (app, pool)
}

/// Tokens checked against the test kit's key, as every test shop's API checks them.
fn auth() -> Auth {
    let args = AuthArgs {
        auth_jwt_key: testkit::auth::KEY.parse().expect("a key"),
        auth_jwt_algorithm: "HS256".to_owned(),
        auth_jwt_issuer: None,
        auth_jwt_audience: None,
    };
    args.auth().expect("the test kit's key")
}

/// What came back.
struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    location: Option<String>,
    body: Value,
}

async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.expect("the router answers");
    let (content_type, location) = {
        let header = |name| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        (header(header::CONTENT_TYPE), header(header::LOCATION))
    };
    let status = response.status();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("body");
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Answer { status, content_type, location, body }
}

/// `POST /orders` with an operator's token, unless `headers` name an `Authorization`.
async fn post(app: &Router, body: &str, headers: &[(&str, &str)]) -> Answer {
    let mut request = Request::post("/orders").header(header::CONTENT_TYPE, "application/json");
    if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("authorization")) {
        request = request.header(header::AUTHORIZATION, testkit::auth::bearer(&testkit::auth::operator()));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    send(app, request.body(Body::from(body.to_owned())).expect("request")).await
}

/// `POST /orders/{order_id}/cancel` with `authorization`, if any.
async fn cancel(app: &Router, order_id: &str, authorization: Option<&str>) -> Answer {
    let mut request = Request::post(format!("/orders/{order_id}/cancel"));
    if let Some(authorization) = authorization {
        request = request.header(header::AUTHORIZATION, authorization);
    }
    send(app, request.body(Body::empty()).expect("request")).await
}

async fn get(app: &Router, path: &str) -> Answer {
    send(app, Request::get(path).body(Body::empty()).expect("request")).await
}

fn assert_problem(answer: &Answer, status: u16, detail_contains: &str) {
    assert_eq!(answer.status.as_u16(), status, "{}", answer.body);
    assert_eq!(answer.content_type.as_deref(), Some("application/problem+json"));
    assert_eq!(answer.body["status"], status);
    let detail = answer.body["detail"].as_str().expect("detail");
    assert!(detail.contains(detail_contains), "detail `{detail}` should mention `{detail_contains}`");
}

async fn count(pool: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("select count(*) from {table}")))
        .fetch_one(pool)
        .await
        .expect("count")
}

/// Every table an accepted order would touch is still empty.
async fn assert_nothing_written(pool: &PgPool) {
    for table in ["orders", "order_lines", "jobs", "outbox", "idempotency_keys", "inbox"] {
        assert_eq!(count(pool, table).await, 0, "orders.{table}");
    }
}

#[tokio::test]
async fn every_bad_input_gets_its_problem_and_writes_nothing() {
    let env = TestEnv::new().await;
    let (app, pool) = api(&env).await;
    let line = r#"{"sku":"SKU-1","quantity":1}"#;
    let many_lines = vec![line; 101].join(",");
    let huge = format!(r#"{{"customerId":"{}","lines":[{line}]}}"#, "x".repeat(70 * 1024));
    let long_line = format!(r#"{{"sku":"{}","quantity":1}}"#, "S".repeat(40));
    let long_lines = vec![long_line; 100].join(",");
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
            "lines[0].quantity must be between 1 and 1000, got 0",
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
        (
            "message too large",
            format!(r#"{{"customerId":"c","lines":[{long_lines}]}}"#),
            413,
            "over the 4096-byte limit (MAX_MESSAGE_BYTES)",
        ),
    ];
    for (name, body, status, detail) in &cases {
        assert_problem(&post(&app, body, &[]).await, *status, detail);
        println!("ok: {name}");
    }
    let not_json = Request::post("/orders")
        .header(header::CONTENT_TYPE, "text/plain")
        .header(header::AUTHORIZATION, testkit::auth::bearer(&testkit::auth::operator()))
        .body(Body::from("{}"));
    assert_problem(&send(&app, not_json.expect("request")).await, 415, "application/json");
    let answer = post(&app, &format!(r#"{{"customerId":"c","lines":[{line}]}}"#), &[("Idempotency-Key", "")]).await;
    assert_problem(&answer, 400, "Idempotency-Key");
    let answer = post(&app, &format!(r#"{{"customerId":"c","lines":[{line}]}}"#), &[("Idempotency-Key", "a b")]).await;
    assert_problem(&answer, 400, "Idempotency-Key");

    assert_problem(&get(&app, "/jobs/not-a-uuid").await, 400, "malformed job id");
    assert_problem(&get(&app, "/orders/12345").await, 400, "malformed order id");
    assert_problem(&get(&app, &format!("/jobs/{}", uuid::Uuid::new_v4())).await, 404, "no job");
    assert_problem(&get(&app, &format!("/orders/{}", uuid::Uuid::new_v4())).await, 404, "no order");
    assert_problem(&get(&app, "/nowhere").await, 404, "no such resource");

    assert_nothing_written(&pool).await;
}

/// The 413 sizes the largest message an order causes: an order whose `order.placed` fits under
/// `MAX_MESSAGE_BYTES` but whose `inventory.reserved` (the same lines, a reservation id in place of
/// a one-letter customer id: 36 bytes more) would not is refused, and nothing is written (issue
/// 56, row 9: accepted, it was quarantined downstream).
#[tokio::test]
async fn an_order_whose_reservation_would_be_over_the_message_limit_is_refused() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    let lines: Vec<shop::OrderLine> =
        (0..40).map(|i| shop::OrderLine { sku: format!("SKU-{i}"), quantity: 1 }).collect();
    // A deadline printed with six digits, the most it can have: the request's prints as many or
    // up to seven bytes fewer, and so does its reservation's.
    let deadline = chrono::DateTime::parse_from_rfc3339("2026-12-06T03:50:00.123456Z").expect("time").to_utc();
    let nil = uuid::Uuid::nil();
    let placed = shop::OrderPlaced {
        order_id: nil,
        job_id: nil,
        customer_id: "c".into(),
        lines: lines.clone(),
        deadline: Some(deadline),
    };
    let placed_bytes = messaging::outbox::published_size(&placed).expect("size");
    let limits = orders_api::api::Limits { max_message_bytes: placed_bytes + 18, ..LIMITS };
    let app = orders_api::app(pool.clone(), Writer::Alone(pool.clone()), limits, auth(), None);
    let body: Vec<String> = lines.iter().map(|line| format!(r#"{{"sku":"{}","quantity":1}}"#, line.sku)).collect();
    let body = format!(r#"{{"customerId":"c","lines":[{}]}}"#, body.join(","));
    let limit = format!("over the {}-byte limit (MAX_MESSAGE_BYTES)", placed_bytes + 18);
    assert_problem(&post(&app, &body, &[]).await, 413, &limit);
    assert_nothing_written(&pool).await;
}

#[tokio::test]
async fn an_accepted_order_is_written_whole_and_reads_back_as_queued_and_accepted() {
    // Each order written alone (the default), then with group commit.
    for grouped in [false, true] {
        let env = TestEnv::new().await;
        let (app, pool) = api_writing(&env, grouped).await;
        let answer = post(
            &app,
            r#"{"customerId":"c-1","lines":[{"sku":"SKU-1","quantity":2},{"sku":"SKU-2","quantity":1.0}]}"#,
            &[],
        )
        .await;
        assert_eq!(answer.status, StatusCode::ACCEPTED, "{}", answer.body);
        let (job_id, order_id) =
            (answer.body["jobId"].as_str().expect("jobId"), answer.body["orderId"].as_str().expect("id"));
        assert_eq!(answer.location, Some(format!("/jobs/{job_id}")));

        let job = get(&app, &format!("/jobs/{job_id}")).await;
        assert_eq!(job.status, StatusCode::OK);
        assert_eq!(job.body["state"], "queued", "nothing published it: no relay runs here");
        assert_eq!(job.body["orderId"], order_id);
        let order = get(&app, &format!("/orders/{order_id}")).await;
        assert_eq!(order.body["status"], "accepted");
        assert_eq!(order.body["customerId"], "c-1");
        assert_eq!(
            order.body["lines"],
            serde_json::json!([{"sku": "SKU-1", "quantity": 2}, {"sku": "SKU-2", "quantity": 1}])
        );

        // The order, its two lines, its job and one order.placed row, under the job as correlation id.
        assert_eq!(count(&pool, "orders").await, 1);
        assert_eq!(count(&pool, "order_lines").await, 2);
        let (message_type, correlation): (String, Option<String>) =
            sqlx::query_as("select message_type, headers ->> 'correlation_id' from outbox where not scheduled")
                .fetch_one(&pool)
                .await
                .expect("row");
        assert_eq!(message_type, "order.placed");
        assert_eq!(correlation.as_deref(), Some(job_id));
        // Its deadline is scheduled beside it, ORDER_DEADLINE ahead, and order.placed carries it.
        let (message_type, correlation, ahead, placed_deadline): (String, Option<String>, f64, bool) = sqlx::query_as(
            "select d.message_type, d.headers ->> 'correlation_id', extract(epoch from d.available_at - d.created_at)::float8,
                    (p.payload ->> 'deadline')::timestamptz = d.available_at
               from outbox d, outbox p where d.scheduled and not p.scheduled",
        )
        .fetch_one(&pool)
        .await
        .expect("the deadline's row");
        assert_eq!(message_type, "order.deadline");
        assert_eq!(correlation.as_deref(), Some(job_id));
        assert!((ahead - LIMITS.order_deadline.as_secs_f64()).abs() < 10.0, "due {ahead} s after it was written");
        assert!(placed_deadline, "order.placed carries another deadline than its row's");
        // The size the API checks against MAX_MESSAGE_BYTES is the size of the body the relay sends.
        let (payload, sent): (Value, i32) =
            sqlx::query_as("select payload, octet_length(payload::text) from outbox where not scheduled")
                .fetch_one(&pool)
                .await
                .expect("row");
        assert_eq!(messaging::outbox::published_size(&payload).expect("serializes"), sent as usize);
    }
}

#[tokio::test]
async fn idempotency_key_replays_the_same_job_and_refuses_another_body() {
    // Each order written alone (the default), then with group commit.
    for grouped in [false, true] {
        let env = TestEnv::new().await;
        let (app, pool) = api_writing(&env, grouped).await;
        let body = r#"{"customerId":"c-7","lines":[{"sku":"SKU-1","quantity":2}]}"#;
        // The same request, formatted differently: still the same request.
        let same = r#"{ "lines": [ { "quantity": 2, "sku": "SKU-1" } ], "customerId": "c-7" }"#;
        let first = post(&app, body, &[("Idempotency-Key", "key-1")]).await;
        assert_eq!(first.status, StatusCode::ACCEPTED);
        let replay = post(&app, same, &[("Idempotency-Key", "key-1")]).await;
        assert_eq!(replay.status, StatusCode::ACCEPTED);
        assert_eq!(replay.body, first.body, "same jobId and orderId");
        assert_eq!(replay.location, first.location);

        let other = post(
            &app,
            r#"{"customerId":"c-7","lines":[{"sku":"SKU-1","quantity":3}]}"#,
            &[("Idempotency-Key", "key-1")],
        )
        .await;
        assert_problem(&other, 422, "Idempotency-Key");

        // Concurrent requests with one new key: exactly one order, one job id for all.
        let mut racers = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let app = app.clone();
            racers.spawn(async move { post(&app, body, &[("Idempotency-Key", "key-race")]).await });
        }
        let mut job_ids = std::collections::HashSet::new();
        while let Some(answer) = racers.join_next().await {
            let answer = answer.expect("task");
            assert_eq!(answer.status, StatusCode::ACCEPTED);
            job_ids.insert(answer.body["jobId"].as_str().expect("jobId").to_owned());
        }
        assert_eq!(job_ids.len(), 1, "one job for one key");

        let a = post(&app, body, &[]).await.body;
        let b = post(&app, body, &[]).await.body;
        assert_ne!(a["jobId"], b["jobId"], "no key: a new job each time");
        assert_eq!(count(&pool, "orders").await, 4);
        // Each order's order.placed and its scheduled order.deadline.
        assert_eq!(count(&pool, "outbox").await, 8);
    }
}

#[tokio::test]
async fn failure_after_order_insert_before_commit_leaves_no_order_and_no_outbox_row() {
    let env = TestEnv::new().await;
    let (app, pool) = api(&env).await;
    // Make the outbox insert (the last write of the transaction) fail, after the order, its lines
    // and its job were inserted.
    sqlx::query("alter table outbox add constraint refuse_orders check (message_type <> 'order.placed') not valid")
        .execute(&pool)
        .await
        .expect("constraint");
    let answer = post(&app, r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":1}]}"#, &[]).await;
    assert_problem(&answer, 500, "internal error");
    assert!(!answer.body.to_string().contains("refuse_orders"), "no database text leaks");
    assert_nothing_written(&pool).await;
}

/// Issue 56, row 6: the routes that change an order take a bearer token, and a customer acts only
/// in its own name. Each refusal is a precise problem and writes nothing.
#[tokio::test]
async fn placing_or_cancelling_needs_a_token_and_a_customer_acts_only_for_itself() {
    let env = TestEnv::new().await;
    let (app, pool) = api(&env).await;
    let body = r#"{"customerId":"alice","lines":[{"sku":"SKU-1","quantity":1}]}"#;
    let alice = testkit::auth::bearer(&testkit::auth::customer("alice"));
    let bob = testkit::auth::bearer(&testkit::auth::customer("bob"));

    // No token, a cross-site form's POST (no header, another content type), a forged or an
    // expired token: 401 with the bearer challenge, before the body is read.
    let forged = {
        let (head, claims, _) = {
            let token = testkit::auth::customer("alice");
            let mut parts = token.splitn(3, '.').map(str::to_owned);
            (parts.next().expect("head"), parts.next().expect("claims"), parts.next())
        };
        format!("Bearer {head}.{claims}.AAAA")
    };
    let expired =
        testkit::auth::bearer(&testkit::auth::sign(serde_json::json!({"sub": "alice", "exp": 1_000_000_000})));
    for authorization in ["", "Basic YWxpY2U6eA==", forged.as_str(), expired.as_str()] {
        let mut request = Request::post("/orders").header(header::CONTENT_TYPE, "application/json");
        if !authorization.is_empty() {
            request = request.header(header::AUTHORIZATION, authorization);
        }
        let answer = send(&app, request.body(Body::from(body)).expect("request")).await;
        assert_problem(&answer, 401, "");
    }
    let form = Request::post("/orders")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from("customerId=alice"))
        .expect("request");
    assert_eq!(send(&app, form).await.status, StatusCode::UNAUTHORIZED);
    let no_token = app
        .clone()
        .oneshot(Request::post("/orders").body(Body::from(body)).expect("request"))
        .await
        .expect("an answer");
    let challenge = no_token.headers().get(header::WWW_AUTHENTICATE).and_then(|v| v.to_str().ok());
    assert_eq!(challenge, Some(r#"Bearer realm="orders""#));

    // Bob may not order in Alice's name.
    assert_problem(&post(&app, body, &[("Authorization", &bob)]).await, 403, "may not order in \"alice\"'s name");
    assert_nothing_written(&pool).await;

    // Alice may; then only she or an operator may cancel it.
    let placed = post(&app, body, &[("Authorization", &alice)]).await;
    assert_eq!(placed.status, StatusCode::ACCEPTED, "{}", placed.body);
    let order_id = placed.body["orderId"].as_str().expect("orderId").to_owned();
    assert_problem(&cancel(&app, &order_id, None).await, 401, "");
    assert_problem(&cancel(&app, &order_id, Some(&bob)).await, 403, "another customer's");
    let status = || async {
        sqlx::query_scalar::<_, String>("select status from orders").fetch_one(&pool).await.expect("status")
    };
    assert_eq!(status().await, "accepted", "refused cancels changed nothing");
    assert_eq!(count(&pool, "outbox").await, 2, "order.placed and order.deadline only");
    assert_eq!(cancel(&app, &order_id, Some(&alice)).await.status, StatusCode::ACCEPTED);
    assert_eq!(status().await, "cancelled");
    let reason: Option<String> =
        sqlx::query_scalar("select last_error from jobs").fetch_one(&pool).await.expect("reason");
    assert_eq!(reason.as_deref(), Some(orders_api::api::CANCELLED_BY_CUSTOMER));

    // An operator places in anyone's name and cancels anyone's order.
    let placed = post(&app, &body.replace("alice", "carol"), &[]).await;
    assert_eq!(placed.status, StatusCode::ACCEPTED, "{}", placed.body);
    let operator = testkit::auth::bearer(&testkit::auth::operator());
    let order_id = placed.body["orderId"].as_str().expect("orderId");
    assert_eq!(cancel(&app, order_id, Some(&operator)).await.status, StatusCode::ACCEPTED);
}
