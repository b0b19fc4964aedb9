//! The exporter's configuration, and the spans it hands to the SDK.

use std::collections::HashMap;

use super::*;
use messaging_core::trace::TraceContext;

fn config(vars: &[(&str, &str)]) -> Result<Option<Config>, String> {
    let vars: HashMap<String, String> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    Config::from_vars(|name| vars.get(name).cloned(), "billing-worker")
}

#[test]
fn off_unless_an_endpoint_is_named_or_when_disabled() {
    assert_eq!(config(&[]), Ok(None));
    assert_eq!(config(&[("OTEL_SERVICE_NAME", "x")]), Ok(None));
    let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/");
    assert_eq!(config(&[endpoint, ("OTEL_SDK_DISABLED", "true")]), Ok(None));
    assert_eq!(config(&[endpoint, ("OTEL_TRACES_EXPORTER", "none")]), Ok(None));
}

#[test]
fn the_standard_variables_are_read_with_their_defaults() {
    let on = config(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")]).expect("valid").expect("on");
    assert_eq!(on.endpoint, "http://collector:4318/v1/traces");
    assert_eq!(on.protocol, Protocol::HttpBinary, "http/protobuf, as the specification's default");
    assert_eq!(on.resource, vec![("service.name".to_owned(), "billing-worker".to_owned())]);
    assert_eq!((on.timeout, on.schedule_delay), (Duration::from_secs(10), Duration::from_secs(5)));
    assert_eq!((on.max_queue, on.max_batch), (2048, 512));

    let on = config(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:4318"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/custom"),
        ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=a%20b,tenant=shop"),
        ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,service.name=from-resource"),
        ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
    ])
    .expect("valid")
    .expect("on");
    assert_eq!(on.endpoint, "http://collector:4318/custom");
    assert_eq!(on.protocol, Protocol::HttpJson);
    assert_eq!(on.headers, vec![("api-key".into(), "a b".into()), ("tenant".into(), "shop".into())]);
    assert_eq!(
        on.resource,
        vec![
            ("service.name".to_owned(), "from-resource".to_owned()),
            ("deployment.environment".to_owned(), "staging".to_owned())
        ]
    );
    assert_eq!(on.schedule_delay, Duration::from_millis(200));
}

#[test]
fn an_https_endpoint_carries_its_tls_files_to_the_client() {
    let on = config(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector:4318"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/run/ca.pem"),
    ])
    .expect("valid")
    .expect("on");
    assert_eq!(on.endpoint, "https://collector:4318/v1/traces?cacertfile=%2Frun%2Fca.pem");
    let files = crate::runtime::tls::TlsFiles::of_url(&url::Url::parse(&on.endpoint).expect("url"));
    assert_eq!(files.ca.as_deref(), Some(std::path::Path::new("/run/ca.pem")));
}

#[test]
fn what_it_cannot_honour_is_refused_by_name() {
    let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
    for (vars, names) in [
        (vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "ftp://collector:4318")], "ftp://collector:4318/v1/traces"),
        (vec![endpoint, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")], "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"),
        (vec![endpoint, ("OTEL_TRACES_EXPORTER", "zipkin")], "OTEL_TRACES_EXPORTER=zipkin"),
        (vec![endpoint, ("OTEL_BSP_SCHEDULE_DELAY", "5s")], "OTEL_BSP_SCHEDULE_DELAY=5s"),
        (vec![endpoint, ("OTEL_EXPORTER_OTLP_HEADERS", "no-equals")], "OTEL_EXPORTER_OTLP_HEADERS"),
    ] {
        let error = config(&vars).expect_err("refused");
        assert!(error.contains(names), "{error}");
    }
}

/// A processor that keeps what it is handed.
#[derive(Debug, Default)]
struct Kept(std::sync::Mutex<Vec<SpanData>>);

impl SpanProcessor for Kept {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {}
    fn on_end(&self, span: SpanData) {
        self.0.lock().expect("lock").push(span);
    }
    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }
    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

#[test]
fn a_finished_span_with_trace_ids_goes_to_the_processor_under_those_ids_and_others_do_not() {
    use tracing::field::Empty;
    use tracing_subscriber::layer::SubscriberExt;

    let kept = Arc::new(Kept::default());
    let layer = SpanLayer { processor: kept.clone(), scope: InstrumentationScope::builder("messaging").build() };
    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let context = TraceContext::continuing(Some(caller));
    tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
        let span = tracing::info_span!(
            "delivery",
            otel.kind = "consumer",
            otel.status_code = Empty,
            endpoint = "billing.inventory-reserved",
            attempt = 2_u32,
            trace_id = Empty,
            span_id = Empty,
            parent_id = Empty,
            sampled = Empty,
        );
        context.record_on(&span);
        span.record("otel.status_code", "error");
        drop(span);
        // No trace ids: a log span only.
        drop(tracing::info_span!("relay_batch", rows = 3));
        // The caller asked for this trace not to be recorded.
        let unsampled = TraceContext::continuing(Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"));
        let span =
            tracing::info_span!("delivery", trace_id = Empty, span_id = Empty, parent_id = Empty, sampled = Empty);
        unsampled.record_on(&span);
    });
    let spans = kept.0.lock().expect("lock");
    let [span] = spans.as_slice() else { panic!("only the sampled span with trace ids: {spans:?}") };
    assert_eq!(span.span_context.trace_id(), TraceId::from(0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736_u128));
    assert_eq!(span.span_context.span_id(), SpanId::from(context.span_id));
    assert_eq!(span.parent_span_id, SpanId::from(0x00f0_67aa_0ba9_02b7_u64));
    assert!(span.parent_span_is_remote, "the parent came in a traceparent");
    assert_eq!(span.name, "delivery");
    assert_eq!(span.span_kind, SpanKind::Consumer);
    assert!(matches!(span.status, Status::Error { .. }));
    assert_eq!(
        span.attributes,
        [KeyValue::new("endpoint", "billing.inventory-reserved"), KeyValue::new("attempt", 2_i64)]
    );
}

#[test]
fn a_span_of_a_planned_length_ends_that_long_after_it_began() {
    use tracing::field::Empty;
    use tracing_subscriber::layer::SubscriberExt;

    let kept = Arc::new(Kept::default());
    let layer = SpanLayer { processor: kept.clone(), scope: InstrumentationScope::builder("messaging").build() };
    let delivery = TraceContext::continuing(Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    let wait = delivery.child();
    tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
        let span = tracing::info_span!(
            "wait",
            otel.duration_ms = 120_000_u64,
            trace_id = Empty,
            span_id = Empty,
            parent_id = Empty,
            sampled = Empty,
        );
        wait.record_on(&span);
    });
    let spans = kept.0.lock().expect("lock");
    let [span] = spans.as_slice() else { panic!("one span: {spans:?}") };
    assert_eq!(span.end_time.duration_since(span.start_time).expect("ends after it begins"), Duration::from_secs(120));
    assert_eq!(span.parent_span_id, SpanId::from(delivery.span_id), "a child of the delivery's span");
    assert_eq!(span.span_context.trace_id(), TraceId::from(delivery.trace_id));
    assert!(span.attributes.is_empty(), "otel.duration_ms is no attribute: {:?}", span.attributes);
}
