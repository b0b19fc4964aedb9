//! One order is one trace: the caller's `traceparent` is continued by the API, stored with the
//! `order.placed` row, published by the relay, continued by each consumer's delivery span, and
//! handed on in the rows it writes and the job events published about it; each hop's span is the
//! parent of the next. With `OTEL_*` naming a collector, the same spans reach it under those ids,
//! with the relay's publish of each row and each wait between a consumer's attempts.

use std::sync::{Arc, Mutex};

use lapin::{
    options::{BasicGetOptions, QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
};
use messaging::{envelope, trace::TraceContext};
use serde_json::Value;
use sqlx::PgPool;
use testkit::{
    eventually,
    shop::{Options, Shop, WAIT},
};
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

/// A hex span id of OTLP/JSON as a number.
fn span_id(hex: &Value) -> u64 {
    u64::from_str_radix(hex.as_str().expect("a hex span id"), 16).expect("a hex span id")
}

/// (span id, parent id) of the delivery spans `service` exported for `message_id` that ended with
/// `outcome`.
fn delivery_spans(spans: &[(String, Value)], service: &str, message_id: Uuid, outcome: &str) -> Vec<(u64, u64)> {
    let string = |value: String| serde_json::json!({ "stringValue": value });
    spans
        .iter()
        .filter(|(from, span)| {
            from == service
                && span["name"] == "delivery"
                && attribute(span, "message_id") == Some(&string(message_id.to_string()))
                && attribute(span, "outcome") == Some(&string(outcome.to_owned()))
        })
        .map(|(_, span)| (span_id(&span["spanId"]), span_id(&span["parentSpanId"])))
        .collect()
}

/// The collector's stand-in and the variables that make every service export to it, in
/// `protocol` (`http/protobuf` or `http/json`).
async fn exporting(protocol: &str) -> (Vec<(&'static str, String)>, Arc<Mutex<Vec<(String, Value)>>>) {
    let (endpoint, received) = collector().await;
    let variables = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol.to_owned()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_owned()),
    ];
    (variables, received)
}

/// Place one order of `sku` with the caller's `traceparent`, and wait until its job has succeeded.
async fn place_as_caller(shop: &Shop, sku: &str) -> Uuid {
    let body = format!(r#"{{"customerId":"c","lines":[{{"sku":"{sku}","quantity":1}}]}}"#);
    let response = shop.post_order(&body, &[("traceparent", CALLER)]).await;
    assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
    let job: Uuid = response.json()["jobId"].as_str().expect("jobId").parse().expect("uuid");
    shop.wait_for_state(job, "succeeded").await;
    job
}

#[tokio::test]
async fn one_order_is_one_trace_and_each_hop_is_the_parent_of_the_next() {
    let (otel, received) = exporting("http/protobuf").await;
    let shop =
        Shop::start(Options { demo_faults: true, consumer_env: otel.clone(), relay_env: otel, ..Options::default() })
            .await;
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
    place_as_caller(&shop, "FLAKY-1").await;

    let caller = TraceContext::parse(CALLER).expect("caller");
    let (placed, placed_id) = row(&shop.orders, "order.placed").await;
    let (reserved, reserved_id) = row(&shop.inventory, "inventory.reserved").await;
    let (invoiced, _) = row(&shop.billing, "invoice.created").await;
    for hop in [placed, reserved, invoiced] {
        assert_eq!(hop.trace_id, caller.trace_id, "one trace: {hop}");
    }
    assert_ne!(placed.span_id, caller.span_id, "the API's own span is the parent of order.placed");

    // Every delivery span of the two workers, as the collector gets them: one success and two
    // retries each.
    let spans = eventually("the workers' delivery spans at the collector", WAIT, || async {
        let spans = received.lock().expect("lock").clone();
        let count = |service, id, outcome| delivery_spans(&spans, service, id, outcome).len();
        let all = [("inventory-worker", placed_id), ("billing-worker", reserved_id)]
            .into_iter()
            .all(|(service, id)| count(service, id, "succeeded") == 1 && count(service, id, "retried") == 2);
        all.then_some(spans)
    })
    .await;

    // Inventory's successful delivery of order.placed: a child of the API's span, and the parent
    // of inventory.reserved; billing's likewise one hop further.
    let inventory = delivery_spans(&spans, "inventory-worker", placed_id, "succeeded");
    assert_eq!(inventory, [(reserved.span_id, placed.span_id)], "inventory's span between the API and billing");
    let billing = delivery_spans(&spans, "billing-worker", reserved_id, "succeeded");
    assert_eq!(billing, [(invoiced.span_id, reserved.span_id)], "billing's span continues inventory's");

    // The job events: in the trace, each a child of the failed attempt's delivery span.
    let mut failed_spans: Vec<u64> = delivery_spans(&spans, "inventory-worker", placed_id, "retried")
        .into_iter()
        .chain(delivery_spans(&spans, "billing-worker", reserved_id, "retried"))
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

    // Each wait between attempts: a span of the tier's length, a child of the attempt that failed.
    let waits: Vec<(u64, u64)> = spans
        .iter()
        .filter(|(from, span)| (from == "inventory-worker" || from == "billing-worker") && span["name"] == "wait")
        .filter(|(_, span)| span["traceId"] == caller.trace_hex())
        .map(|(_, span)| {
            let nanos = |key: &str| span[key].as_str().and_then(|time| time.parse::<u64>().ok()).expect(key);
            (span_id(&span["parentSpanId"]), (nanos("endTimeUnixNano") - nanos("startTimeUnixNano")) / 1_000_000)
        })
        .collect();
    let mut parents: Vec<u64> = waits.iter().map(|(parent, _)| *parent).collect();
    parents.sort_unstable();
    assert_eq!(parents, failed_spans, "one wait after each failed attempt, its child");
    let mut lengths: Vec<u64> = waits.iter().map(|(_, millis)| *millis).collect();
    lengths.sort_unstable();
    assert_eq!(lengths, [100, 100, 300, 300], "each wait lasts its tier (RETRY_DELAYS 100ms,300ms)");

    // The relay's publish of each row: a producer span, a child of the span that wrote the row.
    for (hop, message_id) in [(placed, placed_id), (reserved, reserved_id)] {
        let publish = eventually("the relay's publish span", WAIT, || async {
            let spans = received.lock().expect("lock").clone();
            spans.into_iter().find(|(from, span)| {
                from == "relay"
                    && span["name"] == "publish"
                    && attribute(span, "message_id")
                        == Some(&serde_json::json!({ "stringValue": message_id.to_string() }))
            })
        })
        .await
        .1;
        assert_eq!(publish["traceId"], caller.trace_hex(), "{publish}");
        assert_eq!(span_id(&publish["parentSpanId"]), hop.span_id, "a child of the row's writer: {publish}");
        assert_eq!(publish["kind"], 4, "a producer span: {publish}");
        assert_eq!(attribute(&publish, "outcome"), Some(&serde_json::json!({ "stringValue": "confirmed" })));
        assert_eq!(attribute(&publish, "marked"), Some(&serde_json::json!({ "boolValue": true })), "{publish}");
    }
    let _ = connection.close(200, "bye".into()).await;
}

/// An OTLP/HTTP request's body as OTLP's JSON: as sent with `application/json`, or decoded from
/// `application/x-protobuf`.
fn otlp_json(headers: &axum::http::HeaderMap, body: &[u8]) -> Value {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message;
    let content_type = headers.get(axum::http::header::CONTENT_TYPE).and_then(|value| value.to_str().ok());
    match content_type {
        Some("application/json") => serde_json::from_slice(body).expect("OTLP JSON"),
        Some("application/x-protobuf") => {
            let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
            serde_json::to_value(request).expect("as OTLP JSON")
        }
        other => panic!("an OTLP request of content type {other:?}"),
    }
}

/// A stand-in OpenTelemetry collector: an OTLP/HTTP receiver that keeps every span it is sent,
/// with its resource's `service.name`.
async fn collector() -> (String, Arc<Mutex<Vec<(String, Value)>>>) {
    let received = Arc::new(Mutex::new(Vec::new()));
    let store = received.clone();
    let receive = move |headers: axum::http::HeaderMap, body: axum::body::Bytes| async move {
        let body = otlp_json(&headers, &body);
        let mut spans = store.lock().expect("lock");
        for resource in body["resourceSpans"].as_array().into_iter().flatten() {
            let service = resource["resource"]["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|attribute| attribute["key"] == "service.name")
                .and_then(|attribute| attribute["value"]["stringValue"].as_str())
                .unwrap_or_default()
                .to_owned();
            for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                for span in scope["spans"].as_array().into_iter().flatten() {
                    spans.push((service.clone(), span.clone()));
                }
            }
        }
        axum::http::StatusCode::OK
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let app = axum::Router::new().route("/v1/traces", axum::routing::post(receive));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, received)
}

/// The one span `service` exported whose parent is `parent` and whose name is `name`.
fn child_of(spans: &[(String, Value)], service: &str, name: &str, parent: &str) -> Option<Value> {
    spans
        .iter()
        .find(|(from, span)| from == service && span["name"] == name && span["parentSpanId"] == parent)
        .map(|(_, span)| span.clone())
}

fn attribute<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"].as_array()?.iter().find(|attribute| attribute["key"] == key).map(|attribute| &attribute["value"])
}

#[tokio::test]
async fn with_otel_variables_set_every_hop_s_span_reaches_the_collector_as_one_trace() {
    let (otel, received) = exporting("http/json").await;
    let mut consumer_env = otel.clone();
    consumer_env.push(("TRACE_VIEW_URL", "http://jaeger.example:16686/trace/{traceId}".to_owned()));
    let shop = Shop::start(Options { consumer_env, relay_env: otel, ..Options::default() }).await;
    let job = place_as_caller(&shop, "SKU-1").await;

    // API → inventory → billing → the status consumer's delivery of invoice.created, each span the
    // parent of the next, all in the caller's trace.
    let caller = TraceContext::parse(CALLER).expect("caller");
    let chain = eventually("the order's spans at the collector", WAIT, || async {
        let spans = received.lock().expect("lock").clone();
        let api = child_of(&spans, "orders-api", "POST /orders", &format!("{:016x}", caller.span_id))?;
        let inventory = child_of(&spans, "inventory-worker", "delivery", api["spanId"].as_str()?)?;
        let billing = child_of(&spans, "billing-worker", "delivery", inventory["spanId"].as_str()?)?;
        let status = child_of(&spans, "orders-api", "delivery", billing["spanId"].as_str()?)?;
        // The relay's publishes of order.placed and invoice.created: siblings of the deliveries.
        child_of(&spans, "relay", "publish", api["spanId"].as_str()?)?;
        child_of(&spans, "relay", "publish", billing["spanId"].as_str()?)?;
        Some([api, inventory, billing, status])
    })
    .await;
    for span in &chain {
        assert_eq!(span["traceId"], caller.trace_hex(), "{span}");
        let nanos = |key: &str| span[key].as_str().and_then(|time| time.parse::<u64>().ok()).expect(key);
        assert!(nanos("startTimeUnixNano") <= nanos("endTimeUnixNano"), "{span}");
    }
    let [api, inventory, billing, _] = &chain;
    assert_eq!(api["kind"], 2, "the API's span is a server span");
    assert_eq!(inventory["kind"], 5, "a delivery is a consumer span");
    assert_eq!(attribute(inventory, "endpoint"), Some(&serde_json::json!({ "stringValue": "inventory.order-placed" })));
    assert_eq!(attribute(billing, "outcome"), Some(&serde_json::json!({ "stringValue": "succeeded" })));
    assert_eq!(billing["status"]["code"].as_i64().unwrap_or(0), 0, "a handled delivery is no error (unset)");

    // The job's story links to the trace's page in the viewer TRACE_VIEW_URL names.
    let story = shop.job_events(job).await;
    assert_eq!(story["traceId"], caller.trace_hex());
    let link = format!("http://jaeger.example:16686/trace/{}", caller.trace_hex());
    assert_eq!(story["traceUrl"], link);
    let events = story["events"].as_array().expect("events");
    let linked = events.iter().filter(|event| event["traceUrl"] == link).count();
    let traced = events.iter().filter(|event| !event["traceId"].is_null()).count();
    assert!(linked > 1 && linked == traced, "each step with a trace links it: {story}");
}
