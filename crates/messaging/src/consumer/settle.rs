//! From a delivery to its outcome: decode it, apply it (waiting out a database outage), and
//! settle it by what happened: ack, retry or park. A redelivery runs through the crash ledger
//! first; a batch that fails is applied again message by message.

use std::{future::Future, sync::Arc};

use lapin::message::Delivery;
use tracing::Instrument;
use uuid::Uuid;

use super::{Applied, Handler, HandlerError, Runtime, acks::InFlight, session::Io};
use crate::{
    consumer::crashes,
    envelope::{self, Incoming, Unreadable},
    publisher::PublishError,
    runtime::{
        db,
        metrics::Handled,
        shutdown::Shutdown,
        trace::{self, TraceContext},
    },
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

impl<H: Handler> Runtime<H> {
    /// [`Self::handle_delivery`] inside the delivery's span.
    pub(super) async fn process(self: Arc<Self>, delivery: InFlight, io: Io) -> Result<(), PublishError> {
        let Arrived { delivery, decoded, context, span } = self.arrived(delivery);
        let handled = self.handle_delivery(delivery, decoded, io).instrument(span);
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
                    let handled = Arc::clone(&self).handle_delivery(delivery, decoded, io.clone()).instrument(span);
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
            let settled = self.settle(delivery, &io, &message);
            trace::scope(context, settled.instrument(span)).await?;
        }
        Ok(())
    }

    /// Handle one delivery from arrival to ack. An error means the delivery could not be settled
    /// (the broker connection failed): it stays unacked and comes back on the next session.
    async fn handle_delivery(
        self: Arc<Self>,
        delivery: InFlight,
        decoded: Result<Incoming, Unreadable>,
        io: Io,
    ) -> Result<(), PublishError> {
        let message = match decoded {
            Ok(message) => message,
            Err(unreadable) => {
                let retry_count = envelope::retry_count(delivery.delivery());
                return self.park(delivery, &io.publisher, retry_count, &unreadable.to_string()).await;
            }
        };
        if !delivery.delivery().redelivered {
            return self.settle(delivery, &io, &message).await;
        }

        // A redelivery, running alone. Commit its start before the handler runs: if this process
        // dies now, the count stays, and the next process sees how often it has done so.
        let endpoint = self.settings.endpoint.name;
        let starts = self
            .when_reachable(&io.ended, || async {
                let start = crashes::record_start(&self.pool, endpoint, message.message_id);
                Ok(db::within(db::QUERY_DEADLINE, start).await?)
            })
            .await;
        let settled = match starts {
            None => return Ok(()),
            Some(Ok(starts)) if starts > self.settings.max_crashes => {
                let crashes = starts - 1;
                let reason = format!(
                    "crashed its consumer {crashes} times: handled alone, it never finished (process killed, \
                     panicked or hung); not handled again"
                );
                // Not settled (the connection failed)? Then it returns here before its count is
                // forgotten, so that when it comes back it is parked at once instead of crashing
                // its consumer again.
                self.park(delivery, &io.publisher, message.retry_count, &reason).await?;
                Ok(())
            }
            Some(Ok(_)) => self.settle(delivery, &io, &message).await,
            // The ledger itself fails (not an outage): handle the message; the broker's delivery
            // limit remains the crash net.
            Some(Err(error)) => {
                tracing::warn!(%error, "crash ledger unavailable");
                self.settle(delivery, &io, &message).await
            }
        };
        // Settled, or handed back on a lost connection: either way this process lives, so this
        // start was no crash. (If this fails, the start stays counted: the bound errs towards
        // parking a redelivered message early, never towards losing one.)
        let forgotten = db::within(db::QUERY_DEADLINE, crashes::forget(&self.pool, endpoint, message.message_id));
        if let Err(error) = forgotten.await {
            tracing::warn!(%error, "crash ledger entry not cleared");
        }
        settled
    }

    /// Apply a readable message and settle its delivery by the outcome: ack, or retry, park or
    /// defer it. The last three publish a copy first, and are held beside the session's work
    /// ([`Io::hold`]): a broker that blocks publishing holds them, not the deliveries behind.
    async fn settle(self: &Arc<Self>, delivery: InFlight, io: &Io, message: &Incoming) -> Result<(), PublishError> {
        // What a held settlement takes with it (cloned only for one).
        let owned = || (Arc::clone(self), io.publisher.clone(), message.clone());
        match self.when_reachable(&io.ended, || self.apply(message)).await {
            None => {
                tracing::info!("session ended during a database outage; the broker will redeliver");
            }
            Some(Ok(Applied::Waits { follows })) => {
                let (runtime, publisher, message) = owned();
                io.hold(async move { runtime.defer(delivery, &publisher, &message, follows).await });
            }
            Some(Ok(applied)) => {
                delivery.ack().await?;
                self.acked(applied);
            }
            // `Unavailable` is waited out above; were one to get here, it would be retried.
            Some(Err(HandlerError::Transient(error) | HandlerError::Unavailable(error))) => {
                let (runtime, publisher, message) = owned();
                match self.settings.policy.next_delay(message.retry_count) {
                    Some(delay) => {
                        io.hold(async move { runtime.retry(delivery, &publisher, &message, delay, error.text()).await })
                    }
                    None => {
                        let reason = format!("gave up after {} attempts: {error}", message.attempt());
                        io.hold(async move { runtime.park(delivery, &publisher, message.retry_count, &reason).await });
                    }
                }
            }
            Some(Err(HandlerError::Permanent(error))) => {
                let (runtime, publisher, message) = owned();
                io.hold(async move { runtime.park(delivery, &publisher, message.retry_count, error.text()).await });
            }
        }
        Ok(())
    }

    /// `work` on the database, repeated with backoff for as long as the database is unreachable: an
    /// outage spends none of the message's attempts and parks nothing. If a commit's outcome was
    /// lost with the connection, the inbox tells on the next try. `None` if the session ended first
    /// (shutdown, or a lost connection): the delivery stays unacked and the broker redelivers it.
    async fn when_reachable<T, F, Fut>(&self, session_ended: &Shutdown, mut work: F) -> Option<Result<T, HandlerError>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, HandlerError>>,
    {
        let mut waits = 0;
        // Counted as held from the first unanswered try until this returns, whichever way.
        let mut held = None;
        loop {
            match work().await {
                Err(HandlerError::Unavailable(error)) => {
                    held.get_or_insert_with(|| self.metrics.held());
                    let delay = self.settings.reconnect.delay(waits);
                    waits += 1;
                    tracing::warn!(%error, ?delay, "database unreachable; will apply again");
                    if !session_ended.sleep(delay).await {
                        return None;
                    }
                }
                outcome => return Some(outcome),
            }
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
