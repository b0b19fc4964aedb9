//! Spans to an OpenTelemetry collector: OTLP over HTTP with the JSON encoding, opt-in through the
//! standard `OTEL_*` environment variables and off unless one names an endpoint.
//!
//! Which spans: every `tracing` span that records a `trace_id` and a `span_id` (hex, as
//! [`TraceContext::record_on`](crate::runtime::trace::TraceContext::record_on) writes them): the API's
//! `POST /orders` and each consumer's delivery span. Their ids are the ones that travel in the
//! `traceparent` headers, so the collector sees one order as one trace across every service. The
//! span's other fields become its attributes; `otel.kind` (`server`, `consumer`, …) and
//! `otel.status_code` (`error`) set its kind and status, as `tracing-opentelemetry` reads them.
//! A span whose trace the caller marked as not sampled is not exported.
//!
//! How: spans are queued as they close (never blocking the service: a full queue drops the span
//! and counts it) and a thread of their own sends them in batches, so a slow or absent collector
//! costs the service nothing but those spans. [`Exporter`]'s drop sends what is queued, within a
//! bound, when the binary exits.
//!
//! The variables read, with their defaults (the names and meanings of the OpenTelemetry
//! specification): `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as is) or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (+ `/v1/traces`), unset = off; `OTEL_SDK_DISABLED`;
//! `OTEL_TRACES_EXPORTER` (`otlp` or `none`); `OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL` (only
//! `http/json`); `OTEL_EXPORTER_OTLP[_TRACES]_HEADERS`; `OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT`
//! (10000 ms); `OTEL_SERVICE_NAME` (else `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, else the
//! binary's name); `OTEL_RESOURCE_ATTRIBUTES`; `OTEL_BSP_SCHEDULE_DELAY` (5000 ms),
//! `OTEL_BSP_MAX_QUEUE_SIZE` (2048), `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (512);
//! `OTEL_EXPORTER_OTLP[_TRACES]_CERTIFICATE` (the CA file of an `https://` endpoint, beside the
//! system's roots), `..._CLIENT_CERTIFICATE` and `..._CLIENT_KEY` (a client certificate).

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tracing::{
    Subscriber,
    field::{Field, Visit},
    span,
};
use tracing_subscriber::{Layer, layer::Context, registry::LookupSpan};

/// How long [`Exporter`]'s drop waits for the last spans to be sent.
const FLUSH_BOUND: Duration = Duration::from_secs(3);

/// Where and how to send spans, read from `OTEL_*`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// The full URL spans are POSTed to, e.g. `http://127.0.0.1:4318/v1/traces`.
    pub endpoint: String,
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
        if let Some(protocol) = either("PROTOCOL").filter(|protocol| protocol.trim() != "http/json") {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: this exporter sends `http/json`, which every collector's \
                 OTLP receiver accepts; set that"
            ));
        }
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

/// The running exporter: its thread sends what the [`SpanLayer`] queues. Dropping it sends what
/// is still queued, within a few seconds.
#[derive(Debug)]
pub struct Exporter {
    flush: mpsc::UnboundedSender<std::sync::mpsc::SyncSender<()>>,
}

/// Start the export thread for `config`; the layer goes into the `tracing` subscriber.
pub fn start(config: Config) -> std::io::Result<(SpanLayer, Exporter)> {
    let (spans, queued) = mpsc::channel(config.max_queue);
    let (flush, flushes) = mpsc::unbounded_channel();
    let dropped = Arc::new(AtomicU64::new(0));
    let layer = SpanLayer { spans, dropped: dropped.clone() };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new()
        .name("otel-export".into())
        .spawn(move || runtime.block_on(export(config, queued, flushes, dropped)))?;
    Ok((layer, Exporter { flush }))
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let (done, sent) = std::sync::mpsc::sync_channel(1);
        if self.flush.send(done).is_ok() {
            let _ = sent.recv_timeout(FLUSH_BOUND);
        }
    }
}

/// The export thread's loop: a batch goes out when it is full, when the oldest span in it has
/// waited `schedule_delay`, and on a flush.
async fn export(
    config: Config,
    mut queued: mpsc::Receiver<FinishedSpan>,
    mut flushes: mpsc::UnboundedReceiver<std::sync::mpsc::SyncSender<()>>,
    dropped: Arc<AtomicU64>,
) {
    let mut sender = Sender { config, failing: false };
    let mut batch = Vec::new();
    let mut due = None;
    loop {
        let wait = due.map_or(Duration::from_secs(3600), |due: Instant| due.saturating_duration_since(Instant::now()));
        tokio::select! {
            span = queued.recv() => match span {
                Some(span) => {
                    due.get_or_insert_with(|| Instant::now() + sender.config.schedule_delay);
                    batch.push(span);
                    if batch.len() >= sender.config.max_batch {
                        sender.send(std::mem::take(&mut batch), &dropped).await;
                        due = None;
                    }
                }
                None => break,
            },
            flush = flushes.recv() => {
                while let Ok(span) = queued.try_recv() {
                    batch.push(span);
                }
                for chunk in std::mem::take(&mut batch).chunks(sender.config.max_batch) {
                    sender.send(chunk.to_vec(), &dropped).await;
                }
                due = None;
                match flush {
                    Some(done) => { let _ = done.try_send(()); }
                    None => break,
                }
            }
            () = tokio::time::sleep(wait), if due.is_some() => {
                sender.send(std::mem::take(&mut batch), &dropped).await;
                due = None;
            }
        }
    }
}

/// Sends batches, and says when sending starts and stops failing (not on every batch).
struct Sender {
    config: Config,
    failing: bool,
}

impl Sender {
    async fn send(&mut self, batch: Vec<FinishedSpan>, dropped: &AtomicU64) {
        if batch.is_empty() {
            return;
        }
        let lost = dropped.swap(0, Ordering::Relaxed);
        if lost > 0 {
            tracing::warn!(spans = lost, "spans dropped: the export queue was full (OTEL_BSP_MAX_QUEUE_SIZE)");
        }
        let body = request_body(&self.config, &batch).to_string();
        let headers: Vec<(&str, &str)> =
            self.config.headers.iter().map(|(name, value)| (name.as_str(), value.as_str())).collect();
        let sent = tokio::time::timeout(
            self.config.timeout,
            crate::runtime::http::request("POST", &self.config.endpoint, &headers, Some(&body)),
        )
        .await;
        let failure = match sent {
            Ok(Ok(response)) if (200..300).contains(&response.status) => None,
            Ok(Ok(response)) => Some(format!("HTTP {}: {}", response.status, String::from_utf8_lossy(&response.body))),
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!("no answer within {:?}", self.config.timeout)),
        };
        match failure {
            Some(error) if !self.failing => {
                tracing::warn!(endpoint = %self.config.endpoint, %error, spans = batch.len(), "spans not exported; dropping them until the collector answers");
                self.failing = true;
            }
            Some(_) => {}
            None if self.failing => {
                tracing::info!(endpoint = %self.config.endpoint, "spans exported again");
                self.failing = false;
            }
            None => {}
        }
    }
}

/// One OTLP `ExportTraceServiceRequest`, JSON-encoded (ids in hex, times in nanoseconds as
/// strings, as the OTLP/JSON mapping asks).
fn request_body(config: &Config, batch: &[FinishedSpan]) -> Value {
    let resource: Vec<Value> =
        config.resource.iter().map(|(key, value)| json!({ "key": key, "value": { "stringValue": value } })).collect();
    let spans: Vec<Value> = batch.iter().map(FinishedSpan::json).collect();
    json!({ "resourceSpans": [{
        "resource": { "attributes": resource },
        "scopeSpans": [{ "scope": { "name": "messaging", "version": env!("CARGO_PKG_VERSION") }, "spans": spans }],
    }] })
}

/// The `tracing` layer that queues every finished span that carries trace ids.
#[derive(Debug)]
pub struct SpanLayer {
    spans: mpsc::Sender<FinishedSpan>,
    dropped: Arc<AtomicU64>,
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

/// A closed span, queued for export.
#[derive(Debug, Clone)]
struct FinishedSpan {
    name: String,
    start: SystemTime,
    end: SystemTime,
    fields: Fields,
}

impl FinishedSpan {
    fn json(&self) -> Value {
        let nanos = |at: SystemTime| at.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos().to_string();
        let kind = match self.fields.kind.as_deref() {
            Some("server") => 2,
            Some("client") => 3,
            Some("producer") => 4,
            Some("consumer") => 5,
            _ => 1,
        };
        let attributes: Vec<Value> = self
            .fields
            .attributes
            .iter()
            .map(|(key, value)| {
                let value = match value {
                    Attribute::Text(text) => json!({ "stringValue": text }),
                    Attribute::Int(int) => json!({ "intValue": int.to_string() }),
                    Attribute::Bool(flag) => json!({ "boolValue": flag }),
                    Attribute::Float(float) => json!({ "doubleValue": float }),
                };
                json!({ "key": key, "value": value })
            })
            .collect();
        let mut span = json!({
            "traceId": format!("{:032x}", self.fields.trace_id.unwrap_or_default()),
            "spanId": format!("{:016x}", self.fields.span_id.unwrap_or_default()),
            "name": self.name,
            "kind": kind,
            "startTimeUnixNano": nanos(self.start),
            "endTimeUnixNano": nanos(self.end),
            "attributes": attributes,
            "status": if self.fields.error { json!({ "code": 2 }) } else { json!({}) },
        });
        if let Some(parent) = self.fields.parent_id {
            span["parentSpanId"] = json!(format!("{parent:016x}"));
        }
        span
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
        if open.fields.trace_id.is_none() || open.fields.span_id.is_none() || open.fields.unsampled {
            return;
        }
        let name = open.fields.name.clone().unwrap_or_else(|| open.name.to_owned());
        let finished = FinishedSpan { name, start: open.start, end: SystemTime::now(), fields: open.fields };
        if self.spans.try_send(finished).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests;
