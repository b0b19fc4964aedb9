//! The outcomes that are not an ack: a retry copy to the next wait tier, or a parked copy with
//! its reason, each confirmed and reported as a `job.*` event before the original is acked (but
//! for a job event's own: see [`contracts::is_job_event`]).

use std::sync::Arc;

use chrono::Utc;
use lapin::{BasicProperties, types::AMQPValue};
use messaging_core::{
    contracts::{self, JobEvent, JobQuarantined, JobRetryScheduled},
    envelope, trace,
};
use tracing::Instrument;
use uuid::Uuid;

use super::{
    Handler, Runtime,
    acks::InFlight,
    session::Io,
    settle::{Settled, delivery_span},
};
use crate::{
    publisher::{Pending, PublishError, Publisher},
    runtime::{metrics::Handled, shutdown::Shutdown},
};

/// The job a retry or a parking of this delivery is reported to (its correlation id), if any: none
/// for a `job.*` event's own, which would report on itself.
fn reported_job(properties: &BasicProperties) -> Option<Uuid> {
    let job_event = properties.kind().as_ref().is_some_and(|kind| contracts::is_job_event(kind.as_str()));
    envelope::correlation_id(properties).filter(|_| !job_event)
}

/// The wait before the next attempt, as a span of the message's trace (a child of this attempt's
/// delivery span) that lasts the wait tier's delay from now: no process sits through the wait, so
/// the span is of its planned length (`otel.duration_ms`); the next attempt's delivery span shows
/// when the message came back. Only for the collector: none is made unless spans are exported
/// and the trace is sampled.
fn waits(queue: &str, delay: std::time::Duration, next_attempt: u32) {
    if !crate::runtime::otel::exporting() {
        return;
    }
    let Some(delivery) = trace::current().filter(|delivery| delivery.sampled) else { return };
    let delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
    let span = tracing::info_span!(
        "wait",
        queue,
        delay_ms,
        next_attempt,
        otel.duration_ms = delay_ms,
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
        parent_id = tracing::field::Empty,
        sampled = tracing::field::Empty,
    );
    delivery.child().record_on(&span);
}

impl<H: Handler> Runtime<H> {
    /// Re-publish a copy to the wait tier for `delay`, then ack the original. The copy goes to the
    /// wait queue through the endpoint's own exchange and comes back to its work queue only.
    pub(super) async fn retry(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        retry_count: u32,
        delay: std::time::Duration,
        error: &str,
    ) -> Result<(), PublishError> {
        let endpoint = &self.settings.endpoint;
        let raw = delivery.delivery();
        let next_retry = i64::from(retry_count) + 1;
        let properties = envelope::with_headers(
            &raw.properties,
            &[(envelope::HEADER_RETRY_COUNT, AMQPValue::LongLongInt(next_retry))],
        );
        let wait_queue = endpoint.wait_queue(delay);
        let copy = publisher.send(&endpoint.direct_exchange(), &wait_queue, &raw.data, properties).await?;
        let ids = reported_job(&raw.properties).zip(envelope::message_id(&raw.properties));
        let attempt = retry_count.saturating_add(1);
        let event = ids.map(|(job_id, message_id)| JobRetryScheduled {
            job_id,
            endpoint: endpoint.name.to_owned(),
            message_id,
            message_type: raw.properties.kind().as_ref().map_or("", |kind| kind.as_str()).to_owned(),
            attempt,
            next_attempt: attempt.saturating_add(1),
            next_attempt_at: Utc::now() + delay,
            error: error.to_owned(),
        });
        let event = self.send_event(publisher, event).await;
        copy.confirmed().await?;
        waits(&wait_queue, delay, attempt.saturating_add(1));
        self.settle_event(event).await;
        delivery.ack().await?;
        self.count(Handled::Retried);
        tracing::warn!(?delay, error, "transient failure; retry scheduled");
        Ok(())
    }

    /// Publish the delivery, untouched but for our headers, to the parking queue; once the broker
    /// has confirmed the copy, give up its place in its key's order (an endpoint ordered by key),
    /// then ack it. A park that fails keeps the place: the key's later messages wait for it as
    /// they would for any message not yet applied, instead of passing a message parked nowhere.
    /// If the session ends (`ended`) while the give-up waits for the database, the delivery is left
    /// unacked ([`Settled::LeftUnacked`]): it comes back and is parked again.
    pub(super) async fn park(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        ended: &Shutdown,
        retry_count: u32,
        reason: &str,
    ) -> Result<Settled, PublishError> {
        let endpoint = &self.settings.endpoint;
        let properties = &delivery.delivery().properties;
        let parked_properties = envelope::with_headers(
            properties,
            &[
                (envelope::HEADER_LAST_ERROR, envelope::string_value(reason)),
                (envelope::HEADER_RETRY_COUNT, AMQPValue::LongLongInt(i64::from(retry_count))),
                (envelope::HEADER_ENDPOINT, envelope::string_value(endpoint.name)),
                (envelope::HEADER_PARKED_AT, envelope::string_value(&Utc::now().to_rfc3339())),
            ],
        );
        let parked = publisher
            .send(&endpoint.direct_exchange(), &endpoint.parking_queue(), &delivery.delivery().data, parked_properties)
            .await?;
        let event = reported_job(properties).map(|job_id| JobQuarantined {
            job_id,
            endpoint: endpoint.name.to_owned(),
            message_id: envelope::message_id(properties),
            message_type: properties.kind().as_ref().map(|kind| kind.to_string()),
            attempt: retry_count + 1,
            error: reason.to_owned(),
            redrive_count: properties
                .headers()
                .as_ref()
                .and_then(|headers| envelope::header_u32(headers, envelope::HEADER_REDRIVE_COUNT))
                .unwrap_or(0),
        });
        let event = self.send_event(publisher, event).await;
        parked.confirmed().await?;
        if endpoint.ordered_by_key
            && let Some(ordering) = properties.headers().as_ref().and_then(envelope::ordering)
        {
            let message_type = properties.kind().as_ref().map(|kind| kind.as_str());
            if !self.give_up_place(message_type, &ordering, ended).await {
                tracing::info!(
                    "session ended before the parked message's place was given up; the broker will redeliver it"
                );
                return Ok(Settled::LeftUnacked);
            }
        }
        self.settle_event(event).await;
        delivery.ack().await?;
        self.count(Handled::Parked);
        tracing::error!(reason, "message parked");
        Ok(Settled::Acked)
    }

    /// Park a message the broker dead-letters from the work queue (its delivery limit): with the
    /// broker's reason, our headers only, and a `job.quarantined` event, so that its job ends too.
    pub(super) async fn park_dead_lettered(self: Arc<Self>, delivery: InFlight, io: Io) -> Result<(), PublishError> {
        let raw = delivery.delivery();
        let span = delivery_span("dead_letter", self.settings.endpoint.name, raw, None);
        let reason = envelope::broker_death(&raw.properties).unwrap_or_else(|| "dead-lettered by the broker".into());
        let retry_count = envelope::retry_count(raw);
        self.park(delivery, &io.publisher, &io.ended, retry_count, &reason).instrument(span).await.map(|_| ())
    }

    /// Send a `job.*` event (pipelined with the retry or park publish it reports).
    async fn send_event<C: JobEvent>(&self, publisher: &Publisher, event: Option<C>) -> Option<Pending> {
        let (body, properties) = envelope::job_event(&event?).ok()?;
        match publisher.send(C::EXCHANGE, C::TYPE, &body, properties).await {
            Ok(pending) => Some(pending),
            Err(error) => {
                tracing::warn!(%error, event = C::TYPE, "job event not sent");
                None
            }
        }
    }

    /// Job events are informational (the status consumer applies them monotonically): a lost one
    /// is logged, and does not stop the retry or park it describes from being acked.
    async fn settle_event(&self, pending: Option<Pending>) {
        if let Some(pending) = pending
            && let Err(error) = pending.confirmed().await
        {
            tracing::warn!(%error, "job event not confirmed");
        }
    }

    pub(super) fn count(&self, outcome: Handled) {
        self.metrics.handled(outcome);
        let span = tracing::Span::current();
        span.record("outcome", outcome.as_str());
        if matches!(outcome, Handled::Retried | Handled::Parked) {
            // A failed attempt: its exported span shows as an error (`crate::runtime::otel`).
            span.record("otel.status_code", "error");
        }
        // In the delivery's span: with its trace and span ids, for whoever follows a trace in logs.
        tracing::debug!(outcome = outcome.as_str(), "delivery settled");
    }
}
