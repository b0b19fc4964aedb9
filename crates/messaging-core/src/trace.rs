//! W3C trace context (`traceparent`) carried from hop to hop, so that one order is one trace
//! across every service. An API request starts a trace (or continues the caller's); the outbox row
//! it writes stores a `traceparent` naming the request's span as parent; the relay publishes it as
//! a header; each consumer's delivery span is a child of it, and every message that delivery
//! writes to its outbox, or the runtime publishes about it (job events), names the delivery span
//! as its parent.
//!
//! The context of the work in progress lives in a task-local ([`scope`], [`current`]), so that a
//! message written to the outbox picks it up without every handler passing it along.

use std::{fmt, future::Future};

/// One span's trace context: its trace, its own id, and whether the trace is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace: the same across every hop of one order.
    pub trace_id: u128,
    /// This span.
    pub span_id: u64,
    /// The span this one continues, if any (from the incoming `traceparent`).
    pub parent_id: Option<u64>,
    /// The `sampled` flag, passed along unchanged.
    pub sampled: bool,
}

tokio::task_local! {
    static CURRENT: TraceContext;
}

impl TraceContext {
    /// The first span of a new trace.
    pub fn root() -> Self {
        Self { trace_id: nonzero_u128(), span_id: nonzero_u64(), parent_id: None, sampled: true }
    }

    /// The span that continues `traceparent` (a new span of its trace), or a new trace if it is
    /// missing or malformed.
    pub fn continuing(traceparent: Option<&str>) -> Self {
        match traceparent.and_then(Self::parse) {
            Some(parent) => Self { span_id: nonzero_u64(), parent_id: Some(parent.span_id), ..parent },
            None => Self::root(),
        }
    }

    /// A new span of this trace whose parent is this span: work this span started that is
    /// shown apart from it (the wait before a retry).
    pub fn child(&self) -> Self {
        Self { span_id: nonzero_u64(), parent_id: Some(self.span_id), ..*self }
    }

    /// Parse a `traceparent` header (version 00 layout; later versions are read the same way, as
    /// the specification asks). `None` if malformed or if an id is all zeros.
    pub fn parse(traceparent: &str) -> Option<Self> {
        let mut parts = traceparent.trim().split('-');
        let (version, trace_id, span_id, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex =
            |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
        if !hex(version, 2) || version == "ff" || !hex(trace_id, 32) || !hex(span_id, 16) || !hex(flags, 2) {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let trace_id = u128::from_str_radix(trace_id, 16).ok().filter(|id| *id != 0)?;
        let span_id = u64::from_str_radix(span_id, 16).ok().filter(|id| *id != 0)?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(Self { trace_id, span_id, parent_id: None, sampled: flags & 1 == 1 })
    }

    /// The `traceparent` of a message sent from this span: this span is its parent.
    pub fn traceparent(&self) -> String {
        format!("00-{:032x}-{:016x}-{:02x}", self.trace_id, self.span_id, u8::from(self.sampled))
    }

    /// Write this context into `span`'s `trace_id`, `span_id`, `parent_id` and (when the caller
    /// asked not to record the trace) `sampled` fields, which the span must declare (as
    /// `tracing::field::Empty`): the logs show them, and `otel` exports the span under
    /// these ids.
    pub fn record_on(&self, span: &tracing::Span) {
        span.record("trace_id", self.trace_hex());
        span.record("span_id", format!("{:016x}", self.span_id));
        if let Some(parent) = self.parent_id {
            span.record("parent_id", format!("{parent:016x}"));
        }
        if !self.sampled {
            span.record("sampled", false);
        }
    }

    /// The trace id as 32 hex digits, as logs and tracing back ends show it.
    pub fn trace_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }
}

impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.traceparent())
    }
}

/// Run `work` with `context` as the current trace context.
pub async fn scope<F: Future>(context: TraceContext, work: F) -> F::Output {
    CURRENT.scope(context, work).await
}

/// The current trace context, inside [`scope`].
pub fn current() -> Option<TraceContext> {
    CURRENT.try_with(|context| *context).ok()
}

fn nonzero_u64() -> u64 {
    loop {
        let id = fastrand::u64(..);
        if id != 0 {
            return id;
        }
    }
}

fn nonzero_u128() -> u128 {
    loop {
        let id = fastrand::u128(..);
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips_and_a_child_keeps_the_trace() {
        let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let parent = TraceContext::parse(header).expect("valid");
        assert_eq!(parent.traceparent(), header);
        let child = TraceContext::continuing(Some(header));
        assert_eq!(child.trace_id, parent.trace_id);
        assert_eq!(child.parent_id, Some(0x00f0_67aa_0ba9_02b7));
        assert_ne!(child.span_id, parent.span_id);
        assert!(child.traceparent().starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
    }

    #[test]
    fn malformed_traceparents_start_a_new_trace() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad}");
            assert_eq!(TraceContext::continuing(Some(bad)).parent_id, None, "{bad}");
        }
    }

    #[tokio::test]
    async fn the_current_context_is_the_scope_s() {
        assert_eq!(current(), None);
        let context = TraceContext::root();
        assert_eq!(scope(context, async { current() }).await, Some(context));
    }
}
