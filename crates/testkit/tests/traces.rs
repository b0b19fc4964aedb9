//! One order is one trace: the caller's `traceparent` is continued by the API, stored with the
//! `order.placed` row, published by the relay, continued by each consumer's delivery span, and
//! handed on in the rows it writes and the job events published about it; each hop's span is the
//! parent of the next.

use lapin::{
    options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
};
use messaging::{envelope, trace::TraceContext};
use sqlx::PgPool;
use testkit::shop::{Options, Service, Shop};
use uuid::Uuid;

const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The `traceparent` and message id of the one outbox row of `message_type`.
async fn row(pool: &PgPool, message_type: &str) -> (TraceContext, Uuid) {
    let (traceparent, message_id): (String, Uuid) =
        sqlx::query_as("select headers ->> 'traceparent', message_id from outbox where message_type = $1")
            .bind(message_type)
            .fetch_one(pool)
            .await
            .expect(message_type);
    (TraceContext::parse(&traceparent).expect("a valid traceparent"), message_id)
}

/// `name=value` of a log line, quotes removed.
fn field(line: &str, name: &str) -> Option<u64> {
    let start = line.find(&format!(" {name}="))? + name.len() + 2;
    let value: String = line[start..].trim_start_matches('"').chars().take_while(char::is_ascii_hexdigit).collect();
    u64::from_str_radix(&value, 16).ok()
}

/// (span id, parent id) of the delivery spans of `message_id` that ended with `outcome`, from a
/// service's log.
fn delivery_spans(shop: &mut Shop, service: Service, message_id: Uuid, outcome: &str) -> Vec<(u64, u64)> {
    let log = shop.process(service).log_text();
    log.lines()
        .filter(|line| {
            line.contains("delivery settled")
                && line.contains(&format!("message_id={message_id}"))
                && line.contains(&format!("outcome=\"{outcome}\""))
        })
        .map(|line| (field(line, "span_id").expect("span_id"), field(line, "parent_id").expect("parent_id")))
        .collect()
}

#[tokio::test]
async fn one_order_is_one_trace_and_each_hop_is_the_parent_of_the_next() {
    let options =
        Options { demo_faults: true, log_filter: "info,messaging::consumer=debug".into(), ..Options::default() };
    let mut shop = Shop::start(options).await;
    // Every job event of the run, as the status consumer gets them.
    let connection = shop.env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    channel
        .queue_declare("job-events".into(), QueueDeclareOptions::default(), FieldTable::default())
        .await
        .expect("queue");
    let bind = QueueBindOptions::default();
    channel
        .queue_bind("job-events".into(), "jobs".into(), "job.#".into(), bind, FieldTable::default())
        .await
        .expect("bind");

    // FLAKY-1 fails twice in each worker: its job events come from failed attempts.
    let body = r#"{"customerId":"c","lines":[{"sku":"FLAKY-1","quantity":1}]}"#;
    let response = shop.post_order(body, &[("traceparent", CALLER)]).await;
    assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
    let job: Uuid = response.json()["jobId"].as_str().expect("jobId").parse().expect("uuid");
    shop.wait_for_state(job, "succeeded").await;

    let caller = TraceContext::parse(CALLER).expect("caller");
    let (placed, placed_id) = row(&shop.orders, "order.placed").await;
    let (reserved, reserved_id) = row(&shop.inventory, "inventory.reserved").await;
    let (invoiced, _) = row(&shop.billing, "invoice.created").await;
    for hop in [placed, reserved, invoiced] {
        assert_eq!(hop.trace_id, caller.trace_id, "one trace: {hop}");
    }
    assert_ne!(placed.span_id, caller.span_id, "the API's own span is the parent of order.placed");

    // Inventory's successful delivery of order.placed: a child of the API's span, and the parent
    // of inventory.reserved; billing's likewise one hop further.
    let inventory = delivery_spans(&mut shop, Service::Inventory, placed_id, "succeeded");
    assert_eq!(inventory, [(reserved.span_id, placed.span_id)], "inventory's span between the API and billing");
    let billing = delivery_spans(&mut shop, Service::Billing, reserved_id, "succeeded");
    assert_eq!(billing, [(invoiced.span_id, reserved.span_id)], "billing's span continues inventory's");

    // The job events: in the trace, each a child of the failed attempt's delivery span.
    let mut failed_spans: Vec<u64> = delivery_spans(&mut shop, Service::Inventory, placed_id, "retried")
        .into_iter()
        .chain(delivery_spans(&mut shop, Service::Billing, reserved_id, "retried"))
        .map(|(span, parent)| {
            assert!(parent == placed.span_id || parent == reserved.span_id, "a retry continues the message's parent");
            span
        })
        .collect();
    failed_spans.sort_unstable();
    let mut event_parents = Vec::new();
    while let Some(event) =
        channel.basic_get("job-events".into(), BasicGetOptions { no_ack: true }).await.expect("basic.get")
    {
        let context = TraceContext::parse(&envelope::traceparent(&event.delivery.properties).expect("traceparent"))
            .expect("valid");
        assert_eq!(context.trace_id, caller.trace_id, "job events are in the order's trace");
        event_parents.push(context.span_id);
    }
    event_parents.sort_unstable();
    assert_eq!(event_parents.len(), 4, "two retries in each worker");
    assert_eq!(event_parents, failed_spans, "each job event names its failed attempt's span as parent");
    let _ = connection.close(200, "bye".into()).await;
}
