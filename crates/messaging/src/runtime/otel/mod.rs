//! Spans to an OpenTelemetry collector: OTLP over HTTP, protobuf (the default) or JSON, opt-in
//! through the standard `OTEL_*` environment variables and off unless one names an endpoint.
//!
//! Which spans: every `tracing` span that records a `trace_id` and a `span_id` (hex, as
//! [`TraceContext::record_on`](messaging_core::trace::TraceContext::record_on) writes them): the
//! API's requests and each consumer's delivery span, whose ids are the ones that travel in the
//! `traceparent` headers, so the collector sees one order as one trace across every service; and
//! two made for the collector alone, children of those: the relay's publish of each outbox row
//! and the wait before a consumer's next attempt (made only while [`exporting`]).
//! The span's other fields become its attributes; `otel.kind` (`server`, `consumer`, …) and
//! `otel.status_code` (`error`) set its kind and status, as `tracing-opentelemetry` reads them.
//! `otel.duration_ms` makes a span of a planned length: it ends that long after it began, not
//! when it closes (a retry's wait, which no process sits through).
//! A span whose trace the caller marked as not sampled is not exported.
//!
//! How: [`SpanLayer`] turns each such span, as it closes, into the OpenTelemetry SDK's
//! `SpanData` under our ids, and hands it to the SDK's batch processor, which queues it (never
//! blocking the service: a full queue drops the span) and sends batches from a thread of its own
//! through the SDK's OTLP exporter and our HTTP client ([`client`]: rustls, the endpoint's CA and
//! client certificate). A slow or absent collector costs the service nothing but those spans.
//! [`Exporter`]'s drop sends what is queued, within a bound, when the binary exits. Decision 0014
//! says why the spans are built from ours rather than made by the SDK's tracer.
//!
//! The variables read, with their defaults (the names and meanings of the OpenTelemetry
//! specification): `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is) or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (+ `/v1/traces`), unset = off; `OTEL_SDK_DISABLED`;
//! `OTEL_TRACES_EXPORTER` (`otlp` or `none`); `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL`
//! (`http/protobuf` or `http/json`); `OTEL_EXPORTER_OTLP[_TRACES]_HEADERS`;
//! `OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT` (10000 ms); `OTEL_SERVICE_NAME` (else `service.name` in
//! `OTEL_RESOURCE_ATTRIBUTES`, else the binary's name); `OTEL_RESOURCE_ATTRIBUTES`;
//! `OTEL_BSP_SCHEDULE_DELAY` (5000 ms), `OTEL_BSP_MAX_QUEUE_SIZE` (2048),
//! `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (512); `OTEL_EXPORTER_OTLP[_TRACES]_CERTIFICATE` (the CA file
//! of an `https://` endpoint, beside the system's roots), `..._CLIENT_CERTIFICATE` and
//! `..._CLIENT_KEY` (a client certificate).

mod client;

use std::{
    borrow::Cow,
    sync::Arc,
    time::{Duration, SystemTime},
};

use opentelemetry::{
    InstrumentationScope, KeyValue, Value,
    trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState},
};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    trace::{BatchConfigBuilder, BatchSpanProcessor, SpanData, SpanEvents, SpanExporter, SpanLinks, SpanProcessor},
};
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span,
};
use tracing_subscriber::{Layer, layer::Context, registry::LookupSpan};

/// How long [`Exporter`]'s drop waits for the last spans to be sent.
const FLUSH_BOUND: Duration = Duration::from_secs(3);

/// Whether this process exports spans ([`start`] was called).
static EXPORTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process exports spans: a span made only for the collector (the relay's, one per
/// message) is not worth making otherwise.
pub fn exporting() -> bool {
    EXPORTING.load(std::sync::atomic::Ordering::Relaxed)
}

/// Where and how to send spans, read from `OTEL_*`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The full URL spans are POSTed to, e.g. `http://127.0.0.1:4318/v1/traces`.
    pub endpoint: String,
    /// How the request is encoded: `http/protobuf` or `http/json`.
    pub protocol: Protocol,
    /// Extra request headers (`OTEL_EXPORTER_OTLP_HEADERS`), e.g. an API key.
    pub headers: Vec<(String, String)>,
    /// The resource's attributes, `service.name` first.
    pub resource: Vec<(String, String)>,
    /// How long one export may take.
    pub timeout: Duration,
    /// The longest a finished span waits before it is sent.
    pub schedule_delay: Duration,
    /// Spans waiting to be sent, at most; more are dropped.
    pub max_queue: usize,
    /// Spans per request, at most.
    pub max_batch: usize,
}

impl Config {
    /// Read the process's environment; `default_service` names the service unless the variables
    /// do. `Ok(None)`: export is off. `Err`: a variable is set to something this exporter cannot
    /// honour, in one line that names it.
    pub fn from_env(default_service: &str) -> Result<Option<Self>, String> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|value| !value.trim().is_empty()), default_service)
    }

    /// [`Self::from_env`] over any lookup (tests use a map).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>, default_service: &str) -> Result<Option<Self>, String> {
        // A signal-specific variable wins over the general one.
        let either = |name: &str| {
            var(&format!("OTEL_EXPORTER_OTLP_TRACES_{name}")).or_else(|| var(&format!("OTEL_EXPORTER_OTLP_{name}")))
        };
        if var("OTEL_SDK_DISABLED").is_some_and(|value| value.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        match var("OTEL_TRACES_EXPORTER").as_deref().map(str::trim) {
            None | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => return Err(format!("OTEL_TRACES_EXPORTER={other}: only `otlp` and `none` are supported")),
        }
        let endpoint = match var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            Some(endpoint) => endpoint.trim().to_owned(),
            None => match var("OTEL_EXPORTER_OTLP_ENDPOINT") {
                Some(base) => format!("{}/v1/traces", base.trim().trim_end_matches('/')),
                None => return Ok(None),
            },
        };
        let mut endpoint = match url::Url::parse(&endpoint) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => url,
            _ => return Err(format!("OTLP endpoint {endpoint}: not an http:// or https:// URL")),
        };
        // TLS files, handed to our HTTP client in the URL's query (crate::runtime::tls).
        let files = [
            ("cacertfile", either("CERTIFICATE")),
            ("certfile", either("CLIENT_CERTIFICATE")),
            ("keyfile", either("CLIENT_KEY")),
        ];
        if endpoint.scheme() == "https" && files.iter().any(|(_, file)| file.is_some()) {
            let mut query = endpoint.query_pairs_mut();
            for (key, file) in &files {
                if let Some(file) = file {
                    query.append_pair(key, file.trim());
                }
            }
        }
        let endpoint = endpoint.to_string();
        let protocol = match either("PROTOCOL").as_deref().map(str::trim) {
            None | Some("http/protobuf") => Protocol::HttpBinary,
            Some("http/json") => Protocol::HttpJson,
            Some(other) => {
                return Err(format!(
                    "OTEL_EXPORTER_OTLP_PROTOCOL={other}: this exporter sends OTLP over HTTP, `http/protobuf` or \
                     `http/json`, which a collector's OTLP receiver takes on port 4318; set one of those"
                ));
            }
        };
        let headers = match either("HEADERS") {
            Some(list) => key_values(&list, "OTEL_EXPORTER_OTLP_HEADERS")?,
            None => Vec::new(),
        };
        let mut resource = match var("OTEL_RESOURCE_ATTRIBUTES") {
            Some(list) => key_values(&list, "OTEL_RESOURCE_ATTRIBUTES")?,
            None => Vec::new(),
        };
        let named = resource.iter().position(|(key, _)| key == "service.name").map(|at| resource.remove(at).1);
        let service = var("OTEL_SERVICE_NAME").or(named).unwrap_or_else(|| default_service.to_owned());
        resource.insert(0, ("service.name".to_owned(), service));
        let number = |name: &str, value: Option<String>, default: u64| match value {
            None => Ok(default),
            Some(value) => value.trim().parse::<u64>().map_err(|_| format!("{name}={value}: not a whole number")),
        };
        let timeout = number("OTEL_EXPORTER_OTLP_TIMEOUT", either("TIMEOUT"), 10_000)?;
        let schedule_delay = number("OTEL_BSP_SCHEDULE_DELAY", var("OTEL_BSP_SCHEDULE_DELAY"), 5_000)?;
        let max_queue = number("OTEL_BSP_MAX_QUEUE_SIZE", var("OTEL_BSP_MAX_QUEUE_SIZE"), 2_048)?;
        let max_batch = number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", var("OTEL_BSP_MAX_EXPORT_BATCH_SIZE"), 512)?;
        Ok(Some(Self {
            endpoint,
            protocol,
            headers,
            resource,
            timeout: Duration::from_millis(timeout.max(1)),
            schedule_delay: Duration::from_millis(schedule_delay),
            max_queue: usize::try_from(max_queue.max(1)).unwrap_or(usize::MAX),
            max_batch: usize::try_from(max_batch.max(1)).unwrap_or(usize::MAX),
        }))
    }
}

/// `key1=value1,key2=value2`, values percent-decoded (the W3C baggage format the specification
/// uses for headers and resource attributes).
fn key_values(list: &str, variable: &str) -> Result<Vec<(String, String)>, String> {
    list.split(',')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').ok_or_else(|| format!("{variable}: `{pair}` is not key=value"))?;
            let value = percent_encoding::percent_decode_str(value.trim()).decode_utf8_lossy().into_owned();
            Ok((key.trim().to_owned(), value))
        })
        .collect()
}

/// The running export: the SDK's batch processor and its thread. Dropping it sends what is still
/// queued, within a few seconds, and stops the thread.
#[derive(Debug)]
pub struct Exporter {
    processor: Arc<BatchSpanProcessor>,
}

/// Start exporting for `config`; the layer goes into the `tracing` subscriber.
pub fn start(config: Config) -> Result<(SpanLayer, Exporter), String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client::Client::new(config.timeout).map_err(|error| error.to_string())?)
        .with_endpoint(config.endpoint.clone())
        .with_protocol(config.protocol)
        .with_timeout(config.timeout)
        .with_headers(config.headers.iter().cloned().collect())
        .build()
        .map_err(|error| error.to_string())?;
    let shown = crate::runtime::config::SecretUrl::new(&config.endpoint).to_string();
    let batches = BatchConfigBuilder::default()
        .with_max_queue_size(config.max_queue)
        .with_max_export_batch_size(config.max_batch)
        .with_scheduled_delay(config.schedule_delay)
        .build();
    let mut processor =
        BatchSpanProcessor::new(Reporting { inner: exporter, endpoint: shown, failing: false.into() }, batches);
    let resource = config.resource.iter().map(|(key, value)| KeyValue::new(key.clone(), value.clone()));
    processor.set_resource(&Resource::builder_empty().with_attributes(resource).build());
    let processor = Arc::new(processor);
    let scope = InstrumentationScope::builder("messaging").with_version(env!("CARGO_PKG_VERSION")).build();
    EXPORTING.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok((SpanLayer { processor: processor.clone(), scope }, Exporter { processor }))
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.processor.shutdown_with_timeout(FLUSH_BOUND);
    }
}

/// The OTLP exporter, saying when sending starts and stops failing (not on every batch).
#[derive(Debug)]
struct Reporting<E> {
    inner: E,
    /// The collector, its password masked.
    endpoint: String,
    failing: std::sync::atomic::AtomicBool,
}

impl<E: SpanExporter> SpanExporter for Reporting<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let exported = self.inner.export(batch).await;
        let was_failing = self.failing.swap(exported.is_err(), std::sync::atomic::Ordering::Relaxed);
        match &exported {
            Err(error) if !was_failing => {
                tracing::warn!(endpoint = %self.endpoint, %error, spans, "spans not exported; dropping them until the collector answers");
            }
            Ok(()) if was_failing => tracing::info!(endpoint = %self.endpoint, "spans exported again"),
            _ => {}
        }
        exported
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The `tracing` layer that hands every finished span that carries trace ids to the processor.
#[derive(Debug)]
pub struct SpanLayer {
    processor: Arc<dyn SpanProcessor>,
    /// What produced the spans: this library, at its version.
    scope: InstrumentationScope,
}

/// A span's fields, as recorded so far.
#[derive(Debug, Clone, Default)]
struct Fields {
    trace_id: Option<u128>,
    span_id: Option<u64>,
    parent_id: Option<u64>,
    unsampled: bool,
    kind: Option<String>,
    name: Option<String>,
    error: bool,
    /// `otel.duration_ms`: the span's planned length.
    duration: Option<Duration>,
    attributes: Vec<(&'static str, Attribute)>,
}

#[derive(Debug, Clone)]
enum Attribute {
    Text(String),
    Int(i64),
    Bool(bool),
    Float(f64),
}

impl Fields {
    fn set(&mut self, field: &Field, value: Attribute) {
        let text = || match &value {
            Attribute::Text(text) => text.clone(),
            Attribute::Int(int) => int.to_string(),
            other => format!("{other:?}"),
        };
        match field.name() {
            "trace_id" => self.trace_id = u128::from_str_radix(&text(), 16).ok(),
            "span_id" => self.span_id = u64::from_str_radix(&text(), 16).ok(),
            "parent_id" => self.parent_id = u64::from_str_radix(&text(), 16).ok(),
            "sampled" => self.unsampled = matches!(value, Attribute::Bool(false)),
            "otel.kind" => self.kind = Some(text()),
            "otel.name" => self.name = Some(text()),
            "otel.status_code" => self.error = text().eq_ignore_ascii_case("error"),
            "otel.duration_ms" => self.duration = text().parse().ok().map(Duration::from_millis),
            name => match self.attributes.iter_mut().find(|(key, _)| *key == name) {
                Some((_, old)) => *old = value,
                None => self.attributes.push((name, value)),
            },
        }
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.set(field, Attribute::Text(value.to_owned()));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.set(field, Attribute::Int(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.set(field, i64::try_from(value).map_or_else(|_| Attribute::Text(value.to_string()), Attribute::Int));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.set(field, Attribute::Bool(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.set(field, Attribute::Float(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.set(field, Attribute::Text(format!("{value:?}")));
    }
}

/// A span being recorded: when it started, and its fields.
struct Open {
    start: SystemTime,
    name: &'static str,
    fields: Fields,
}

impl Open {
    /// The span as the SDK exports it, under our ids; `None` without them, or if the caller asked
    /// for its trace not to be recorded.
    fn finish(self, end: SystemTime, scope: &InstrumentationScope) -> Option<SpanData> {
        let Fields { trace_id, span_id, parent_id, unsampled, kind, name, error, duration, attributes } = self.fields;
        if unsampled {
            return None;
        }
        let context = SpanContext::new(
            TraceId::from(trace_id?),
            SpanId::from(span_id?),
            TraceFlags::SAMPLED,
            false,
            TraceState::NONE,
        );
        let kind = match kind.as_deref() {
            Some("server") => SpanKind::Server,
            Some("client") => SpanKind::Client,
            Some("producer") => SpanKind::Producer,
            Some("consumer") => SpanKind::Consumer,
            _ => SpanKind::Internal,
        };
        let attributes = attributes
            .into_iter()
            .map(|(key, value)| {
                let value = match value {
                    Attribute::Text(text) => Value::from(text),
                    Attribute::Int(int) => Value::I64(int),
                    Attribute::Bool(flag) => Value::Bool(flag),
                    Attribute::Float(float) => Value::F64(float),
                };
                KeyValue::new(key, value)
            })
            .collect();
        Some(SpanData {
            span_context: context,
            // Every parent but a wait's came in a `traceparent`, from another process (a hint to the
            // viewer only).
            parent_span_id: parent_id.map_or(SpanId::INVALID, SpanId::from),
            parent_span_is_remote: parent_id.is_some(),
            span_kind: kind,
            name: Cow::Owned(name.unwrap_or_else(|| self.name.to_owned())),
            start_time: self.start,
            end_time: duration.map_or(end, |duration| self.start + duration),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: if error { Status::error("") } else { Status::Unset },
            instrumentation_scope: scope.clone(),
        })
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for SpanLayer {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        span.extensions_mut().insert(Open { start: SystemTime::now(), name: attrs.metadata().name(), fields });
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        if let Some(open) = span.extensions_mut().get_mut::<Open>() {
            values.record(&mut open.fields);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(open) = span.extensions_mut().remove::<Open>() else { return };
        if let Some(finished) = open.finish(SystemTime::now(), &self.scope) {
            self.processor.on_end(finished);
        }
    }
}

#[cfg(test)]
mod tests;
