//! What each of the [`Machine`](super::machine::Machine)'s actions does, as an effect the
//! session runs and whose end it feeds back: count a redelivery's start, apply a delivery or a
//! batch, settle (ack, retry, park, defer or hand back). Each runs in its delivery's span and
//! trace context.

use std::sync::Arc;

use lapin::message::Delivery;
use messaging_core::{
    envelope::{self, Incoming, Unreadable},
    trace::TraceContext,
};
use uuid::Uuid;

use super::{
    Handler, HandlerError, Runtime,
    acks::InFlight,
    crashes,
    machine::{Applied, Arrival, Input, LedgerEntry, Republish, Settlement, Tag},
    session::Io,
};
use crate::{
    publisher::{PublishError, Publisher},
    runtime::{db, metrics::Handled, shutdown::Shutdown},
};

/// A delivery the session holds while its machine tracks it: decoded (or not), with its trace
/// context and, once something is done with it, its span.
pub(super) struct Body {
    pub(super) delivery: InFlight,
    pub(super) decoded: Result<Incoming, Unreadable>,
    pub(super) context: TraceContext,
    /// Made at its first action ([`Self::span`]): a delivery handed back unstarted at the session's
    /// end exports none.
    span: Option<tracing::Span>,
}

impl Body {
    /// The message, if it could be read.
    pub(super) fn message(&self) -> Option<&Incoming> {
        self.decoded.as_ref().ok()
    }

    /// Its span, made the first time it is asked for. The span continues the trace the message
    /// carries (or starts one): what the handler writes to its outbox, and the job events about
    /// it, name this span as parent.
    pub(super) fn span(&mut self, endpoint: &str) -> tracing::Span {
        let Self { delivery, decoded, context, span } = self;
        span.get_or_insert_with(|| {
            let span = delivery_span("delivery", endpoint, delivery.delivery(), decoded.as_ref().ok());
            context.record_on(&span);
            span
        })
        .clone()
    }

    /// Its span if it has one, else a span that records nothing.
    pub(super) fn made_span(&self) -> tracing::Span {
        self.span.clone().unwrap_or_else(tracing::Span::none)
    }
}

/// How an effect ended: what to feed the machine, the bodies it borrowed, and why the session must
/// end, if it must (a settlement that failed, a panic).
pub(super) struct Done {
    pub(super) input: Input,
    pub(super) bodies: Vec<(Tag, Body)>,
    pub(super) error: Option<String>,
}

impl Done {
    fn of(input: Input, bodies: Vec<(Tag, Body)>) -> Self {
        Self { input, bodies, error: None }
    }
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
    /// A delivery arrived: decoded once (its span is made from the decoded envelope, and the
    /// handling uses it), with its trace context, and what the machine reads of it.
    pub(super) fn arrived(&self, delivery: InFlight) -> (Body, Arrival) {
        let endpoint = &self.settings.endpoint;
        let raw = delivery.delivery();
        let decoded = Incoming::decode(raw).and_then(|message| {
            endpoint.check(&message.message_type, message.version)?;
            Ok(message)
        });
        let traceparent = envelope::traceparent(&raw.properties);
        let context = TraceContext::continuing(traceparent.as_deref());
        let arrival = arrival(&delivery, decoded.as_ref().ok());
        (Body { delivery, decoded, context, span: None }, arrival)
    }

    /// Commit one more start of a redelivery in the crash ledger.
    pub(super) async fn count_start(self: Arc<Self>, tag: Tag, body: Body) -> Done {
        let starts = match body.message() {
            Some(message) => {
                let start = crashes::record_start(&self.pool, self.settings.endpoint.name, message.message_id);
                let started = db::within(db::QUERY_DEADLINE, start).await.map_err(HandlerError::from);
                if let Err(error @ (HandlerError::Transient(_) | HandlerError::Permanent(_))) = &started {
                    tracing::warn!(%error, "crash ledger unavailable; handling the message uncounted");
                }
                started
            }
            None => Err(HandlerError::Permanent("unreadable".into())),
        };
        Done::of(Input::Started { tag, starts }, vec![(tag, body)])
    }

    /// Run a delivery's transaction.
    pub(super) async fn apply_one(self: Arc<Self>, tag: Tag, body: Body) -> Done {
        let applied = match &body.decoded {
            Ok(message) => self.apply(message).await,
            Err(unreadable) => Err(HandlerError::Permanent(unreadable.to_string().into())),
        };
        Done::of(Input::Applied { tag, applied }, vec![(tag, body)])
    }

    /// Apply a batch of deliveries (none redelivered) in one transaction, commit, and settle them
    /// with one ack. Should anything in it fail (a handler's error, an outage, the commit, the
    /// time limit), nothing of it commits and the bodies go back to the session: the machine then
    /// applies each message again on its own, exactly as without batching, so that its retry,
    /// parking, attempt count and inbox row are what they would have been.
    pub(super) async fn apply_together(self: Arc<Self>, members: Vec<(Tag, Body)>) -> Done {
        let started = std::time::Instant::now();
        let bodies: Vec<&Body> = members.iter().map(|(_, body)| body).collect();
        match self.apply_batch(&bodies).await {
            Ok(outcomes) => {
                let (deliveries, spans): (Vec<InFlight>, Vec<tracing::Span>) = members
                    .into_iter()
                    .map(|(_, body)| {
                        let span = body.made_span();
                        (body.delivery, span)
                    })
                    .unzip();
                // Acked together, or not at all: a failed ack ends the session, counting nothing.
                if let Err(error) = InFlight::ack_all(deliveries).await {
                    let input = Input::BatchApplied { committed: true };
                    return Done { input, bodies: Vec::new(), error: Some(error.to_string()) };
                }
                self.metrics.batch(true);
                let seconds = started.elapsed().as_secs_f64();
                for (span, applied) in spans.iter().zip(outcomes) {
                    span.in_scope(|| {
                        self.metrics.handling(applied.handling(), seconds);
                        self.acked(applied);
                    });
                }
                Done::of(Input::BatchApplied { committed: true }, Vec::new())
            }
            Err(error) => {
                self.metrics.batch(false);
                tracing::info!(messages = members.len(), %error, "batch not applied; applying its messages one by one");
                Done::of(Input::BatchApplied { committed: false }, members)
            }
        }
    }

    /// Settle a delivery as the machine decided, and forget its start in the crash ledger as
    /// `ledger` says.
    pub(super) async fn settle_one(
        self: Arc<Self>,
        tag: Tag,
        body: Body,
        settlement: Settlement,
        ledger: LedgerEntry,
        io: Io,
    ) -> Done {
        let counted = body.message().map(|message| Counted { message_id: message.message_id, start: ledger });
        let settled = self.settle(body.delivery, &io, settlement, counted).await;
        Done { input: Input::Settled(tag), bodies: Vec::new(), error: settled.err().map(|error| error.to_string()) }
    }

    /// Park what the broker dead-lettered.
    pub(super) async fn park_dead_letter(self: Arc<Self>, delivery: InFlight, io: Io) -> Done {
        let parked = self.park_dead_lettered(delivery, io).await;
        Done { input: Input::DeadLetterParked, bodies: Vec::new(), error: parked.err().map(|error| error.to_string()) }
    }

    /// Settle a delivery as decided: ack it, or hand it back; or publish a copy (retry, park,
    /// defer) and then ack, held beside the session's work ([`Io::hold`]) so that a broker that
    /// blocks publishing holds it, not the deliveries behind. Its start in the crash ledger, if
    /// `counted`, is forgotten as [`LedgerEntry`] says (before a copy is held, after an ack or a
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
                    Some(counted) if counted.start == LedgerEntry::ForgetOnceParked => (None, Some(counted)),
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

    /// Forget the crash ledger's count of starts of `counted`, as its [`LedgerEntry`] says, the
    /// delivery having been `settled` or not. (If this fails, the start stays counted: the bound
    /// errs towards parking a redelivered message early, never towards losing one.)
    async fn forget_start(&self, counted: Option<Counted>, settled: bool) {
        let Some(Counted { message_id, start }) = counted else { return };
        let forget = match start {
            LedgerEntry::NotCounted => false,
            LedgerEntry::Forget => true,
            LedgerEntry::ForgetOnceParked => settled,
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
    start: LedgerEntry,
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
    // Of no parent: the session's span is the consumer's, not the message's (which `record_on`
    // gives it), and a log line reads `delivery{…}` as it always has.
    tracing::info_span!(
        parent: None,
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
