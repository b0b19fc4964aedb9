//! Prometheus counters, rendered in the text exposition format. Deliberately tiny: a handful of
//! labelled counters does not justify a metrics framework in a reference that people read.

use std::{collections::BTreeMap, fmt::Write, sync::Mutex};

/// Deliveries handled, by `endpoint` and `outcome` (succeeded, duplicate, retried, parked).
pub const MESSAGES_HANDLED: &str = "messages_handled_total";
/// Deliveries skipped because the inbox had already recorded their message id, by `endpoint`.
pub const INBOX_DUPLICATES: &str = "inbox_duplicates_skipped_total";
/// Outbox rows published and confirmed, by `database`.
pub const OUTBOX_PUBLISHED: &str = "outbox_published_total";
/// Outbox publishes returned or nacked by the broker, by `database`.
pub const OUTBOX_PUBLISH_FAILURES: &str = "outbox_publish_failures_total";

fn help(name: &str) -> &'static str {
    match name {
        MESSAGES_HANDLED => "Deliveries handled, by endpoint and outcome.",
        INBOX_DUPLICATES => "Redelivered messages skipped because the inbox had already processed them.",
        OUTBOX_PUBLISHED => "Outbox rows published with a broker confirm.",
        OUTBOX_PUBLISH_FAILURES => "Outbox publishes returned (unroutable) or nacked; the rows are retried.",
        _ => "",
    }
}

/// A set of labelled counters.
#[derive(Debug, Default)]
pub struct Metrics {
    // (metric name, rendered label set) -> value; BTreeMap keeps the output stable and grouped.
    counters: Mutex<BTreeMap<(&'static str, String), u64>>,
}

impl Metrics {
    /// Add `by` to counter `name` with `labels`.
    pub fn add(&self, name: &'static str, labels: &[(&str, &str)], by: u64) {
        let key = (name, render_labels(labels));
        let mut counters = self.counters.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        *counters.entry(key).or_default() += by;
    }

    /// Add one.
    pub fn increment(&self, name: &'static str, labels: &[(&str, &str)]) {
        self.add(name, labels, 1);
    }

    /// The current value (0 if never incremented), mainly for tests.
    pub fn get(&self, name: &'static str, labels: &[(&str, &str)]) -> u64 {
        let counters = self.counters.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        counters.get(&(name, render_labels(labels))).copied().unwrap_or(0)
    }

    /// Append every counter to `out` in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let counters = self.counters.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut last = "";
        for ((name, labels), value) in counters.iter() {
            if *name != last {
                let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} counter", help(name));
                last = name;
            }
            let _ = writeln!(out, "{name}{labels} {value}");
        }
    }
}

/// Append a gauge sample (with its HELP/TYPE lines when `first`).
pub fn render_gauge(out: &mut String, name: &str, help: &str, labels: &[(&str, &str)], value: f64, first: bool) {
    if first {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    }
    let _ = writeln!(out, "{name}{} {value}", render_labels(labels));
}

fn render_labels(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let mut out = String::from("{");
    for (i, (key, value)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let escaped = value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let _ = write!(out, "{key}=\"{escaped}\"");
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let metrics = Metrics::default();
        metrics.increment(MESSAGES_HANDLED, &[("endpoint", "a"), ("outcome", "succeeded")]);
        metrics.add(MESSAGES_HANDLED, &[("endpoint", "a"), ("outcome", "succeeded")], 2);
        metrics.increment(INBOX_DUPLICATES, &[("endpoint", "a\"b")]);
        let mut out = String::new();
        metrics.render(&mut out);
        assert!(out.contains("messages_handled_total{endpoint=\"a\",outcome=\"succeeded\"} 3\n"), "{out}");
        assert!(out.contains("inbox_duplicates_skipped_total{endpoint=\"a\\\"b\"} 1\n"), "{out}");
        assert_eq!(out.matches("# TYPE messages_handled_total counter").count(), 1);
    }
}
