//! From a delivery to its outcome: decode it, then perform what [`decide`](super::decide) says,
//! step by step (count a redelivery's start, apply, wait out an outage), and settle it (ack,
//! retry, park, defer or hand back). A batch that fails is applied again message by message.

use std::sync::Arc;

use lapin::message::Delivery;
use messaging_core::{
    envelope::{self, Incoming, Unreadable},
    trace::{self, TraceContext},
};
use tracing::Instrument;
use uuid::Uuid;

use super::{
    Handler, HandlerError, Runtime,
    acks::InFlight,
    crashes,
    decide::{self, Applied, Arrival, Attempt, Decision, Event, Republish, Settlement, Start},
    session::Io,
};
use crate::{
    publisher::{PublishError, Publisher},
    runtime::{db, metrics::Handled, shutdown::Shutdown},
};

/// A delivery as it arrived: decoded (or not), with its span and trace context.
struct Arrived {
    delivery: InFlight,
    decoded: Result<Incoming, Unreadable>,
    context: TraceContext,
    span: tracing::Span,
}

/// A readable delivery in a batch.
pub(super) struct Member {
    pub(super) delivery: InFlight,
    pub(super) message: Incoming,
    pub(super) context: TraceContext,
    pub(super) span: tracing::Span,
}

/// What became of a delivery whose copy was republished: acked, or left unacked for the broker
/// to deliver again (a park whose give-up of its place outlived the session).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settled {
    /// Acked: the copy stands for it.
    Acked,
    /// Left unacked: it comes back, and is parked again.
    LeftUnacked,
}

impl<H: Handler> Runtime<H> {
    /// [`Self::handle`] inside the delivery's span.
    pub(super) async fn process(self: Arc<Self>, delivery: InFlight, io: Io) -> Result<(), PublishError> {
        let Arrived { delivery, decoded, context, span } = self.arrived(delivery);
        let handled = self.handle(delivery, decoded, &io).instrument(span);
        trace::scope(context, handled).await
    }

    /// A delivery decoded once (the span is made from the decoded envelope, and the handling uses
    /// it), with its span and trace context. The span continues the trace the message carries (or
    /// starts one): what the handler writes to its outbox, and the job events about it, name this
    /// span as parent.
    fn arrived(&self, delivery: InFlight) -> Arrived {
        let endpoint = &self.settings.endpoint;
        let raw = delivery.delivery();
        let decoded = Incoming::decode(raw).and_then(|message| {
            endpoint.check(&message.message_type, message.version)?;
            Ok(message)
        });
        let traceparent = envelope::traceparent(&raw.properties);
        let context = TraceContext::continuing(traceparent.as_deref());
        let span = delivery_span("delivery", endpoint.name, raw, decoded.as_ref().ok());
        context.record_on(&span);
        Arrived { delivery, decoded, context, span }
    }

    /// Apply a batch of deliveries (none redelivered) in one transaction, commit, and settle them
    /// with one ack. Should anything in it fail (a handler's error, an outage, the commit, the
    /// time limit), nothing of it commits and each message is applied again on its own, exactly
    /// as without batching: its retry, parking, attempt count and inbox row are what they would
    /// have been.
    pub(super) async fn process_batch(self: Arc<Self>, deliveries: Vec<InFlight>, io: Io) -> Result<(), PublishError> {
        let mut members = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            match self.arrived(delivery) {
                Arrived { delivery, decoded: Ok(message), context, span } => {
                    members.push(Member { delivery, message, context, span });
                }
                // Unreadable: parked at once, as on its own.
                Arrived { delivery, decoded, context, span } => {
                    let handled = self.handle(delivery, decoded, &io).instrument(span);
                    trace::scope(context, handled).await?;
                }
            }
        }
        if members.len() > 1 {
            let started = std::time::Instant::now();
            match self.apply_batch(&members).await {
                Ok(outcomes) => {
                    let (deliveries, spans): (Vec<InFlight>, Vec<tracing::Span>) =
                        members.into_iter().map(|member| (member.delivery, member.span)).unzip();
                    InFlight::ack_all(deliveries).await?;
                    self.metrics.batch(true);
                    let seconds = started.elapsed().as_secs_f64();
                    for (span, applied) in spans.iter().zip(outcomes) {
                        span.in_scope(|| {
                            self.metrics.handling(applied.handling(), seconds);
                            self.acked(applied);
                        });
                    }
                    return Ok(());
                }
                Err(error) => {
                    self.metrics.batch(false);
                    tracing::info!(messages = members.len(), %error, "batch not applied; applying its messages one by one");
                }
            }
        }
        for Member { delivery, message, context, span } in members {
            let handled = self.handle(delivery, Ok(message), &io).instrument(span);
            trace::scope(context, handled).await?;
        }
        Ok(())
    }

    /// What becomes of one delivery, from arrival to its settlement: decided by [`Decision`],
    /// each step performed here. An error means the delivery could not be settled (the broker
    /// connection failed): it stays unacked and comes back on the next session.
    async fn handle(
        self: &Arc<Self>,
        delivery: InFlight,
        decoded: Result<Incoming, Unreadable>,
        io: &Io,
    ) -> Result<(), PublishError> {
        let arrival = arrival(&delivery, decoded.as_ref().ok());
        let message = match decoded {
            Ok(message) => message,
            Err(unreadable) => {
                return self.settle(delivery, io, Decision::unreadable(arrival, &unreadable), None).await;
            }
        };
        let (mut decision, first) = Decision::arrived(&self.rules, arrival);
        let held = || self.metrics.held();
        let settlement =
            decide::drive(&mut decision, first, &io.ended, held, |attempt| self.attempt(attempt, &message)).await;
        let counted = Counted { message_id: message.message_id, start: decision.start() };
        self.settle(delivery, io, settlement, Some(counted)).await
    }

    /// Perform `attempt` on the database and report what it came to.
    async fn attempt(&self, attempt: Attempt, message: &Incoming) -> Event {
        match attempt {
            Attempt::CountStart => {
                let start = crashes::record_start(&self.pool, self.settings.endpoint.name, message.message_id);
                let started = db::within(db::QUERY_DEADLINE, start).await.map_err(HandlerError::from);
                if let Err(error @ (HandlerError::Transient(_) | HandlerError::Permanent(_))) = &started {
                    tracing::warn!(%error, "crash ledger unavailable; handling the message uncounted");
                }
                Event::Started(started)
            }
            Attempt::Apply => Event::Applied(self.apply(message).await),
        }
    }

    /// Settle a delivery as decided: ack it, or hand it back; or publish a copy (retry, park,
    /// defer) and then ack, held beside the session's work ([`Io::hold`]) so that a broker that
    /// blocks publishing holds it, not the deliveries behind. Its start in the crash ledger, if
    /// `counted`, is forgotten as [`Start`] says (before a copy is held, after an ack or a
    /// hand-back; a crash park's once the park is confirmed and acked): the delivery leaves a process that
    /// lives.
    async fn settle(
        self: &Arc<Self>,
        delivery: InFlight,
        io: &Io,
        settlement: Settlement,
        counted: Option<Counted>,
    ) -> Result<(), PublishError> {
        let settled = match settlement {
            Settlement::Ack(applied) => delivery.ack().await.map(|()| self.acked(applied)),
            Settlement::HandBack => {
                tracing::info!("session ended during a database outage; the broker will redeliver");
                Ok(())
            }
            Settlement::Republish(copy) => {
                // Forgotten now, whatever becomes of the copy (a broker blocking publishers may
                // hold it past the session's end); a crash park's count, once the park is
                // confirmed and acked.
                let (now, once_parked) = match counted {
                    Some(counted) if counted.start == Start::ForgetOnceParked => (None, Some(counted)),
                    counted => (counted, None),
                };
                self.forget_start(now, true).await;
                let (runtime, publisher, ended) = (Arc::clone(self), io.publisher.clone(), io.ended.clone());
                io.hold(async move {
                    let settled = runtime.republish(delivery, &publisher, &ended, copy).await;
                    // A park left unacked keeps its start: its redelivery is parked again at once.
                    runtime.forget_start(once_parked, matches!(settled, Ok(Settled::Acked))).await;
                    settled.map(|_| ())
                });
                return Ok(());
            }
        };
        self.forget_start(counted, settled.is_ok()).await;
        settled
    }

    /// Publish the copy a settlement needs, then ack the original (a park may leave it unacked if
    /// the session ends, `ended`, while it waits for the database).
    async fn republish(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        ended: &Shutdown,
        copy: Republish,
    ) -> Result<Settled, PublishError> {
        match copy {
            Republish::Retry { delay, error, retry_count } => {
                self.retry(delivery, publisher, retry_count, delay, &error).await.map(|()| Settled::Acked)
            }
            Republish::Park { reason, retry_count } => {
                self.park(delivery, publisher, ended, retry_count, &reason).await
            }
            Republish::Defer { follows, delay, deferrals } => {
                self.defer(delivery, publisher, follows, delay, deferrals).await.map(|()| Settled::Acked)
            }
        }
    }

    /// Forget the crash ledger's count of starts of `counted`, as its [`Start`] says, the
    /// delivery having been `settled` or not. (If this fails, the start stays counted: the bound
    /// errs towards parking a redelivered message early, never towards losing one.)
    async fn forget_start(&self, counted: Option<Counted>, settled: bool) {
        let Some(Counted { message_id, start }) = counted else { return };
        let forget = match start {
            Start::NotCounted => false,
            Start::Forget => true,
            Start::ForgetOnceParked => settled,
        };
        if !forget {
            return;
        }
        let forgotten = crashes::forget(&self.pool, self.settings.endpoint.name, message_id);
        if let Err(error) = db::within(db::QUERY_DEADLINE, forgotten).await {
            tracing::warn!(%error, "crash ledger entry not cleared");
        }
    }

    /// Count a delivery acked after its transaction: applied, or skipped by the inbox.
    fn acked(&self, applied: Applied) {
        match applied {
            // Not acked here: sent back to wait (`defer`), which counts it.
            Applied::Waits { .. } => {}
            Applied::Done => self.count(Handled::Succeeded),
            Applied::Duplicate => {
                self.count(Handled::Duplicate);
                self.metrics.duplicate();
                tracing::info!("duplicate skipped by the inbox");
            }
        }
    }
}

/// A message whose start the crash ledger may have counted, and what becomes of it.
#[derive(Debug, Clone, Copy)]
struct Counted {
    message_id: Uuid,
    start: Start,
}

/// What a decision reads of a delivery as it arrives: from its envelope when it decoded, else
/// from the raw properties.
fn arrival(delivery: &InFlight, message: Option<&Incoming>) -> Arrival {
    let raw = delivery.delivery();
    let headers = raw.properties.headers().as_ref();
    Arrival {
        redelivered: raw.redelivered,
        retry_count: message.map_or_else(|| envelope::retry_count(raw), |message| message.retry_count),
        deferrals: headers.and_then(|headers| envelope::header_u32(headers, envelope::HEADER_DEFERRALS)).unwrap_or(0),
        place: message.and_then(|message| message.ordering.as_ref()).map(|ordering| ordering.seq),
    }
}

/// The span of one delivery: every line logged while handling it, the handler's included, carries
/// the endpoint, the message's id, type and attempt, and its job. Taken from `message` when the
/// envelope decoded (the usual case: nothing is parsed twice), else from the raw properties.
pub(super) fn delivery_span(
    kind: &'static str,
    endpoint: &str,
    delivery: &Delivery,
    message: Option<&Incoming>,
) -> tracing::Span {
    let properties = &delivery.properties;
    let (message_id, message_type, attempt, job_id) = match message {
        Some(message) => {
            (Some(message.message_id), message.message_type.as_str(), message.attempt(), message.correlation_id)
        }
        None => (
            envelope::message_id(properties),
            properties.kind().as_ref().map_or("", |kind| kind.as_str()),
            envelope::retry_count(delivery).saturating_add(1),
            envelope::correlation_id(properties),
        ),
    };
    let (message_id, job_id) = (OrEmpty(message_id), OrEmpty(job_id));
    let redelivered = delivery.redelivered;
    tracing::info_span!(
        "delivery",
        kind,
        endpoint,
        message_id = %message_id,
        message_type,
        attempt,
        job_id = %job_id,
        redelivered,
        outcome = tracing::field::Empty,
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
        parent_id = tracing::field::Empty,
        sampled = tracing::field::Empty,
    )
}

/// An optional id for a log field: empty when absent (no string made for it).
struct OrEmpty(Option<Uuid>);

impl std::fmt::Display for OrEmpty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(id) => id.fmt(f),
            None => Ok(()),
        }
    }
}
