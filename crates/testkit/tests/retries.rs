//! Failures without loss and without hot loops: stepped retries through wait queues, the attempt
//! cap, parking with a reason, the broker's delivery limit as the crash net, and job states.

mod common;

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use chrono::Utc;
use common::count;
use lapin::types::AMQPValue;
use messaging::{
    consumer::{self, Batching, ConsumerSettings},
    contracts::{Contract, JobRetryScheduled},
    envelope::{self, Headers, Incoming},
    handler::{Handler, HandlerError},
    publisher::Publisher,
    runtime::{
        health::Health,
        shutdown::{self, ShutdownTrigger},
    },
    topology::{self, Binding, Endpoint, RetryPolicy},
};
use sqlx::{PgConnection, PgPool};
use testkit::shop::{Options, Service, WAIT};
use testkit::{TestEnv, eventually};
use uuid::Uuid;

const ENDPOINT: &str = "test.scripted";

/// A handler that records every call and fails as its script says; its effect is a row. A body of
/// `hang` never returns, as a handler stuck on a call without a timeout.
#[derive(Clone)]
struct Scripted {
    calls: Arc<Mutex<Vec<(String, Instant)>>>,
    script: fn(&str, u32) -> Result<(), HandlerError>,
}

impl Scripted {
    fn new(script: fn(&str, u32) -> Result<(), HandlerError>) -> Self {
        Self { calls: Arc::default(), script }
    }
    fn calls_for(&self, body: &str) -> Vec<Instant> {
        let calls = self.calls.lock().expect("lock");
        calls.iter().filter(|(b, _)| b == body).map(|(_, at)| *at).collect()
    }
}

impl Handler for Scripted {
    async fn handle(&self, message: &Incoming, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let body = String::from_utf8_lossy(&message.body).into_owned();
        self.calls.lock().expect("lock").push((body.clone(), Instant::now()));
        if body == "hang" {
            std::future::pending::<()>().await;
        }
        (self.script)(&body, message.attempt())?;
        sqlx::query("insert into effects (body) values ($1)").bind(&body).execute(&mut *tx).await?;
        Ok(())
    }
}

fn endpoint(delivery_limit: u32) -> Endpoint {
    Endpoint {
        name: ENDPOINT,
        bindings: vec![Binding { exchange: "orders", routing_key: ENDPOINT }],
        accepts: vec![(ENDPOINT, 1)],
        delivery_limit,
        ordered_by_key: false,
    }
}

/// A database with messaging's tables and an `effects` table, and the endpoint's queues declared.
async fn prepare(env: &TestEnv, endpoint: &Endpoint, policy: &RetryPolicy) -> PgPool {
    let pool = env.messaging_pool("scripted").await;
    sqlx::query("create table effects (body text not null)").execute(&pool).await.expect("effects");
    env.declare_endpoint(endpoint, policy).await;
    pool
}

async fn publish(env: &TestEnv, bodies: &[&str], job_id: Option<Uuid>) {
    let connection = env.amqp().await;
    let publisher = Publisher::open(&connection).await.expect("publisher");
    for body in bodies {
        let properties = Headers::raw(job_id, 1).properties(Uuid::now_v7(), ENDPOINT, Utc::now());
        publisher.publish("orders", ENDPOINT, body.as_bytes(), properties).await.expect("confirmed");
    }
    let _ = connection.close(200, "bye".into()).await;
}

fn start(
    settings: ConsumerSettings,
    handler: Scripted,
    pool: PgPool,
) -> (ShutdownTrigger, tokio::task::JoinHandle<()>) {
    let (trigger, stop) = shutdown::channel();
    let task = tokio::spawn(consumer::run(settings, Arc::new(handler), pool, Health::default(), stop));
    (trigger, task)
}

fn header(delivery: &lapin::message::Delivery, name: &str) -> Option<AMQPValue> {
    delivery.properties.headers().as_ref()?.inner().get(name).cloned()
}

fn header_text(delivery: &lapin::message::Delivery, name: &str) -> String {
    let headers = delivery.properties.headers().clone().unwrap_or_default();
    envelope::header_text(&headers, name).unwrap_or_else(|| panic!("header {name}: {:?}", header(delivery, name)))
}

#[tokio::test]
async fn poison_at_the_head_is_tried_max_attempts_times_then_parked_while_good_messages_pass() {
    let shop = common::start().await;
    // A real job for the poison message, so the status consumer has something to quarantine.
    let job_id = Uuid::now_v7();
    let order_id = Uuid::now_v7();
    sqlx::query("insert into orders (id, customer_id) values ($1, 'c')")
        .bind(order_id)
        .execute(&shop.orders)
        .await
        .expect("order");
    sqlx::query("insert into jobs (id, order_id, state) values ($1, $2, 'published')")
        .bind(job_id)
        .bind(order_id)
        .execute(&shop.orders)
        .await
        .expect("job");

    let policy = RetryPolicy::new(vec![Duration::from_millis(30), Duration::from_millis(60)], 5);
    let endpoint = endpoint(20);
    let pool = prepare(&shop.env, &endpoint, &policy).await;
    publish(&shop.env, &["poison"], Some(job_id)).await;
    publish(&shop.env, &["good-1", "good-2", "good-3", "good-4", "good-5"], None).await;
    let handler = Scripted::new(|body, _| match body {
        "poison" => Err(HandlerError::Transient("boom: the database said no".into())),
        _ => Ok(()),
    });
    let (trigger, task) =
        start(shop.env.consumer_settings(endpoint.clone(), policy, 1, Batching::OFF), handler.clone(), pool.clone());

    eventually("the poison message to be parked", WAIT, || async {
        (shop.env.queue_depth(&endpoint.parking_queue()).await == Some(1)).then_some(())
    })
    .await;
    let mut good: Vec<String> = sqlx::query_scalar("select body from effects").fetch_all(&pool).await.expect("effects");
    good.sort();
    assert_eq!(good, ["good-1", "good-2", "good-3", "good-4", "good-5"], "every good message processed once");
    assert_eq!(handler.calls_for("poison").len(), 5, "exactly MAX_ATTEMPTS handler calls");

    let parked = shop.env.drain(&endpoint.parking_queue()).await;
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].data, b"poison", "parked with its body");
    assert!(header_text(&parked[0], "last-error").contains("gave up after 5 attempts: boom"));
    assert_eq!(header_text(&parked[0], "endpoint"), ENDPOINT);
    assert_eq!(envelope::retry_count(&parked[0]), 4);

    let job = shop.wait_for_state(job_id, "quarantined").await;
    assert!(job["lastError"].as_str().expect("lastError").contains("boom"), "{job}");
    assert_eq!(job["attempt"], 5);
    trigger.trigger();
    task.await.expect("consumer");
    shop.stop().await;
}

#[tokio::test]
async fn transient_failures_retry_after_each_tier_delay_and_apply_once() {
    let env = TestEnv::new().await;
    let delays = [Duration::from_millis(150), Duration::from_millis(300)];
    let policy = RetryPolicy::new(delays.to_vec(), 5);
    let endpoint = endpoint(20);
    let pool = prepare(&env, &endpoint, &policy).await;
    let handler = Scripted::new(|_, attempt| {
        if attempt <= 2 { Err(HandlerError::Transient(format!("flaky attempt {attempt}").into())) } else { Ok(()) }
    });
    let (trigger, task) =
        start(env.consumer_settings(endpoint.clone(), policy, 4, Batching::OFF), handler.clone(), pool.clone());
    publish(&env, &["flaky"], None).await;

    eventually("the effect", WAIT, || async {
        (count(&pool, "select count(*) from effects").await == 1).then_some(())
    })
    .await;
    let calls = handler.calls_for("flaky");
    assert_eq!(calls.len(), 3);
    for (i, delay) in delays.iter().enumerate() {
        let waited = calls[i + 1] - calls[i];
        assert!(waited >= *delay, "retry {} waited {waited:?}, tier says {delay:?}", i + 1);
    }
    trigger.trigger();
    task.await.expect("consumer");
    // Nothing is left behind, nothing applied twice.
    assert_eq!(count(&pool, "select count(*) from effects").await, 1);
    assert_eq!(env.queue_depth(&endpoint.parking_queue()).await, Some(0));
    assert_eq!(env.queue_depth(ENDPOINT).await, Some(0));
}

#[tokio::test]
async fn a_handler_that_crashes_on_a_message_has_it_parked_by_the_crash_bound_and_its_neighbours_applied_once() {
    let env = TestEnv::new().await;
    let policy = RetryPolicy::new(vec![Duration::from_millis(50)], 5);
    let endpoint = endpoint(topology::DEFAULT_DELIVERY_LIMIT);
    let pool = prepare(&env, &endpoint, &policy).await;
    // A handler bug that takes the delivery's task down: never acked nor nacked by us; the
    // session ends, the channel closes, and the broker returns every unacked delivery.
    let handler = Scripted::new(|body, _| if body == "crash" { panic!("simulated crash") } else { Ok(()) });
    let (trigger, task) =
        start(env.consumer_settings(endpoint.clone(), policy, 4, Batching::OFF), handler.clone(), pool.clone());
    publish(&env, &["crash", "a", "b", "c", "d", "e"], Some(Uuid::now_v7())).await;

    let parked = eventually("the crashing message to be parked", WAIT, || async {
        let parked = env.drain(&endpoint.parking_queue()).await;
        (!parked.is_empty()).then_some(parked)
    })
    .await;
    let reason = header_text(&parked[0], "last-error");
    assert!(reason.starts_with("crashed its consumer 3 times"), "{reason}");
    // Once among its neighbours, then alone up to the bound: never more.
    assert_eq!(handler.calls_for("crash").len(), 4);
    eventually("the neighbours to be applied", WAIT, || async {
        (count(&pool, "select count(*) from effects").await == 5).then_some(())
    })
    .await;
    trigger.trigger();
    task.await.expect("consumer");
    assert_eq!(count(&pool, "select count(*) from effects").await, 5, "each neighbour once");
    assert_eq!(count(&pool, "select count(*) from delivery_starts").await, 0, "no start left counted");
    assert_eq!(env.queue_depth(ENDPOINT).await, Some(0), "not dropped, not stuck");
    assert_eq!(env.queue_depth(&endpoint.parking_queue()).await, Some(0), "only the crashing one was parked");
}

#[tokio::test]
async fn a_handler_that_hangs_is_abandoned_at_the_timeout_and_parked_after_its_attempts_while_others_pass() {
    let env = TestEnv::new().await;
    let policy = RetryPolicy::new(vec![Duration::from_millis(50)], 2);
    let endpoint = endpoint(topology::DEFAULT_DELIVERY_LIMIT);
    let pool = prepare(&env, &endpoint, &policy).await;
    let handler = Scripted::new(|_, _| Ok(()));
    let mut settings = env.consumer_settings(endpoint.clone(), policy, 1, Batching::OFF);
    settings.handler_timeout = Duration::from_millis(300);
    let (trigger, task) = start(settings, handler.clone(), pool.clone());
    publish(&env, &["hang", "after"], Some(Uuid::now_v7())).await;

    let parked = eventually("the hanging message to be parked", WAIT, || async {
        let parked = env.drain(&endpoint.parking_queue()).await;
        (!parked.is_empty()).then_some(parked)
    })
    .await;
    let reason = header_text(&parked[0], "last-error");
    assert_eq!(reason, "gave up after 2 attempts: the handler did not finish within 300ms");
    assert_eq!(handler.calls_for("hang").len(), 2, "one call per attempt");
    eventually("the message behind it to be applied", WAIT, || async {
        (count(&pool, "select count(*) from effects where body = 'after'").await == 1).then_some(())
    })
    .await;
    trigger.trigger();
    task.await.expect("consumer");
    assert_eq!(count(&pool, "select count(*) from inbox").await, 1, "the abandoned transactions left nothing");
}

#[tokio::test]
async fn wait_queue_and_parked_copies_carry_no_broker_header() {
    let env = TestEnv::new().await;
    // The second tier is long: a copy waiting there can be inspected.
    let policy = RetryPolicy::new(vec![Duration::from_millis(50), Duration::from_secs(600)], 5);
    let endpoint = endpoint(topology::DEFAULT_DELIVERY_LIMIT);
    let pool = prepare(&env, &endpoint, &policy).await;
    // Both fail on their first attempt, so their second delivery comes back from a wait queue,
    // dead-lettered by its TTL (with `x-death` and `x-first-death-*`); then one fails again, the
    // other for good.
    let handler = Scripted::new(|body, attempt| match (body, attempt) {
        ("park", 2..) => Err(HandlerError::Permanent("for good".into())),
        _ => Err(HandlerError::Transient("not yet".into())),
    });
    let (trigger, task) =
        start(env.consumer_settings(endpoint.clone(), policy, 4, Batching::OFF), handler.clone(), pool);
    publish(&env, &["wait", "park"], None).await;

    let long_wait = endpoint.wait_queue(Duration::from_secs(600));
    eventually("a copy in the long wait queue and one in parking", WAIT, || async {
        let waiting = env.queue_depth(&long_wait).await == Some(1);
        let parked = env.queue_depth(&endpoint.parking_queue()).await == Some(1);
        (waiting && parked).then_some(())
    })
    .await;
    trigger.trigger();
    task.await.expect("consumer");
    assert_eq!(handler.calls_for("wait").len(), 2, "its second delivery came back through a wait queue");
    for queue in [long_wait, endpoint.parking_queue()] {
        let copies = env.drain(&queue).await;
        let headers = copies[0].properties.headers().clone().expect("headers");
        assert!(headers.inner().contains_key("retry-count"), "{queue}: {headers:?}");
        assert_eq!(env.published_broker_headers(&copies[0]).await, Vec::<String>::new(), "{queue}: {headers:?}");
    }
}

/// Publish raw bytes and properties to the orders exchange as `order.placed`.
async fn publish_raw(env: &TestEnv, body: &[u8], properties: lapin::BasicProperties) {
    let connection = env.amqp().await;
    let publisher = Publisher::open(&connection).await.expect("publisher");
    publisher.publish("orders", "order.placed", body, properties).await.expect("confirmed");
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn unreadable_messages_are_parked_after_one_delivery_and_change_nothing() {
    let shop = common::start().await;
    let before: Vec<(String, i32)> = sqlx::query_as("select sku, available from stock order by sku")
        .fetch_all(&shop.inventory)
        .await
        .expect("stock");
    let readable = Headers::raw(None, 1).properties(Uuid::now_v7(), "order.placed", Utc::now());
    publish_raw(&shop.env, b"{ this is not json", readable).await;
    let no_id = lapin::BasicProperties::default().with_type("order.placed".into());
    publish_raw(&shop.env, br#"{"orderId":"x"}"#, no_id).await;

    let parking = "inventory.order-placed.parking";
    eventually("both to be parked", WAIT, || async { (shop.env.queue_depth(parking).await == Some(2)).then_some(()) })
        .await;
    let parked = shop.env.drain(parking).await;
    let reasons: Vec<String> = parked.iter().map(|d| header_text(d, "last-error")).collect();
    assert!(reasons.iter().any(|r| r.contains("unreadable body")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("message_id")), "{reasons:?}");
    assert!(parked.iter().all(|d| envelope::retry_count(d) == 0), "parked on the first delivery");

    let series =
        |outcome: &str| format!("messages_handled_total{{endpoint=\"inventory.order-placed\",outcome=\"{outcome}\"}}");
    assert_eq!(shop.metric(Service::Inventory, &series("parked")).await, 2);
    assert_eq!(shop.metric(Service::Inventory, &series("retried")).await, 0);
    let after: Vec<(String, i32)> = sqlx::query_as("select sku, available from stock order by sku")
        .fetch_all(&shop.inventory)
        .await
        .expect("stock");
    assert_eq!(before, after);
    assert_eq!(
        count(&shop.inventory, "select count(*) from inbox").await,
        0,
        "the failed transaction left no inbox row"
    );
    assert_eq!(count(&shop.inventory, "select count(*) from outbox").await, 0);
    shop.stop().await;
}

#[tokio::test]
async fn demo_faults_flaky_succeeds_on_attempt_3_poison_is_quarantined_plain_orders_succeed() {
    let mut shop = common::start_with(Options { demo_faults: true, ..Options::default() }).await;
    let flaky = shop.place(&[("FLAKY-1", 1)]).await;
    let poison = shop.place(&[("POISON-1", 1)]).await;
    let plain: Vec<Uuid> = {
        let mut jobs = Vec::new();
        for quantity in 1..=3 {
            jobs.push(shop.place(&[("SKU-1", quantity)]).await);
        }
        jobs
    };

    let job = shop.wait_for_state(flaky, "succeeded").await;
    assert_eq!(job["attempt"], 3, "{job}");
    let job = shop.wait_for_state(poison, "quarantined").await;
    assert_eq!(job["attempt"], 5, "{job}");
    assert!(job["lastError"].as_str().expect("lastError").contains("POISON-1"), "{job}");
    for job_id in &plain {
        let job = shop.wait_for_state(*job_id, "succeeded").await;
        assert_eq!(job["attempt"], 1);
    }
    assert_eq!(count(&shop.billing, "select count(*) from invoices").await, 4, "flaky + 3 plain, each once");
    assert_eq!(shop.env.queue_depth("inventory.order-placed.parking").await, Some(1));

    // Billing retried its copy of inventory.reserved twice; the copies went through billing's own
    // wait queues, so the status consumer (also bound to inventory.reserved) never saw a duplicate.
    let billing_retried = "messages_handled_total{endpoint=\"billing.inventory-reserved\",outcome=\"retried\"}";
    assert_eq!(shop.metric(Service::Billing, billing_retried).await, 2);
    let status_duplicates = "inbox_duplicates_skipped_total{endpoint=\"orders.status\"}";
    assert_eq!(shop.metric(Service::Api, status_duplicates).await, 0);
    let status_reserved: i64 =
        count(&shop.orders, "select count(*) from inbox where message_type = 'inventory.reserved'").await;
    assert_eq!(status_reserved, 4, "one inventory.reserved per reserved order, no fan-out of retries");

    // A retry event that arrives after success (reordered, or late) changes nothing.
    let late = JobRetryScheduled {
        job_id: flaky,
        endpoint: "billing.inventory-reserved".into(),
        message_id: Uuid::now_v7(),
        message_type: "inventory.reserved".into(),
        attempt: 8,
        next_attempt: 9,
        next_attempt_at: Utc::now(),
        error: "late".into(),
    };
    let event_id = Uuid::now_v7();
    let connection = shop.env.amqp().await;
    let publisher = Publisher::open(&connection).await.expect("publisher");
    let properties =
        Headers::of::<JobRetryScheduled>(Some(late.job_id)).properties(event_id, JobRetryScheduled::TYPE, Utc::now());
    let body = serde_json::to_vec(&late).expect("json");
    publisher
        .publish(JobRetryScheduled::EXCHANGE, JobRetryScheduled::TYPE, &body, properties)
        .await
        .expect("confirmed");
    testkit::wait_processed(&shop.orders, event_id, WAIT).await;
    let job = shop.job(flaky).await;
    assert_eq!((job["state"].as_str(), job["attempt"].as_i64()), (Some("succeeded"), Some(3)), "{job}");
    shop.stop().await;
}
