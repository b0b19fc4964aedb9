//! The consumer runtime (DESIGN §5). A service writes a [`Handler`]; the runtime does the rest,
//! once, for every endpoint:
//!
//! 1. manual acks and a bounded prefetch. Ready deliveries are applied in batches of up to
//!    `BATCH_SIZE`, one transaction and one ack per batch, one batch at a time; if anything in a
//!    batch fails, its messages are applied again one by one, so that each outcome below is what
//!    it would be alone (decision 0008). With `BATCH_SIZE=1`, each delivery has its own task and
//!    transaction, up to the prefetch at once;
//! 2. a delivery without a readable `message_id`, or of an unknown type or major version, is
//!    parked at once;
//! 3. otherwise one transaction records the message in the inbox, runs the handler and commits;
//!    only then is the delivery acked. A message the inbox has seen is acked without effect;
//! 4. a transient error re-publishes a copy to the next wait tier with `retry-count + 1`
//!    (confirmed), then acks the original; the last allowed attempt, or a permanent error, parks
//!    the message with its reason (confirmed), then acks. Both emit a `job.*` event. An
//!    unreachable database is not the message's fault: the delivery is held and applied again
//!    with backoff until the database answers, spending no attempt (decision 0003);
//! 5. there is no `nack(requeue = true)` for a failure: a message that fails never spins. Only
//!    shutdown and lost connections leave deliveries unacked, and the broker redelivers those;
//! 6. a redelivery (the broker's `redelivered` flag) may be the message that crashed the last
//!    process, so it runs alone, with its start committed first to the crash ledger
//!    ([`crate::crashes`]). A message that keeps killing its consumer is parked once it has
//!    started `max_crashes` times alone without finishing; the messages prefetched beside it lose
//!    nothing (decision 0005). A handler that hangs is abandoned after `handler_timeout`;
//! 7. what the broker itself dead-letters (its delivery limit, a last resort) arrives in the
//!    endpoint's intake queue and is parked with the broker's reason and a job event, like any
//!    other parked message.
//!
//! Acking happens in exactly one place, [`InFlight`], whose methods consume it: a delivery cannot
//! be acked twice, and cannot be acked before its outcome is durable.

use std::{collections::BTreeSet, future::Future, sync::Arc, time::Duration};

use chrono::Utc;
use futures_util::{FutureExt, StreamExt};
use lapin::{
    BasicProperties, Connection,
    message::Delivery,
    options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::{AMQPValue, FieldTable},
};
use sqlx::{PgConnection, PgPool};
use tokio::task::JoinSet;
use tracing::Instrument;
use uuid::Uuid;

use crate::{
    backoff::Backoff,
    broker::{self, Link, Session, SessionEnd},
    config::{BrokerArgs, ConsumerArgs, SecretUrl},
    contracts::{JobEvent, JobQuarantined, JobRetryScheduled},
    crashes, db,
    duration::format_duration,
    envelope::{self, Headers, Incoming, Unreadable},
    failpoint,
    health::Health,
    inbox,
    metrics::{EndpointMetrics, Handled, Handling},
    publisher::{PublishError, Publisher},
    shutdown::Shutdown,
    topology::{self, Endpoint, RetryPolicy},
    trace::{self, TraceContext},
};

/// How a handler failed. Business refusals are not errors: they commit an outcome like any result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// The database cannot be reached: not the message's fault, so no attempt is spent. The
    /// runtime keeps the delivery and applies it again once the database answers.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// Might work later (a deadlock, a serialization failure, a flaky dependency): retry after a
    /// wait, spending an attempt.
    #[error("{0}")]
    Transient(String),
    /// Will never work (a bug, a message we cannot make sense of): park now.
    #[error("{0}")]
    Permanent(String),
}

impl From<sqlx::Error> for HandlerError {
    /// An unreachable database is `Unavailable`; transaction conflicts, resource limits and a
    /// garbled connection are transient; anything the database rejects on its merits (a
    /// constraint, a type) would fail the same way again, so it is permanent.
    fn from(error: sqlx::Error) -> Self {
        if crate::db::is_unreachable(&error) {
            return Self::Unavailable(error.to_string());
        }
        let transient = match &error {
            sqlx::Error::Database(e) => {
                // 40 rollback (serialization, deadlock), 53 resources, 57 operator (e.g. a
                // cancelled statement; the shutdown codes are `Unavailable`).
                let class = e.code().map(|code| code.chars().take(2).collect::<String>());
                matches!(class.as_deref(), Some("40" | "53" | "57"))
            }
            sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
            _ => false,
        };
        if transient { Self::Transient(error.to_string()) } else { Self::Permanent(error.to_string()) }
    }
}

impl From<Unreadable> for HandlerError {
    fn from(error: Unreadable) -> Self {
        Self::Permanent(error.to_string())
    }
}

/// What a service implements: apply one message inside the runtime's transaction. The inbox row
/// is already written in `tx`; the handler adds its effect and any outbox rows, and must not
/// commit. Returning an error rolls everything back, inbox row included.
pub trait Handler: Send + Sync + 'static {
    /// Apply `message`.
    fn handle(
        &self,
        message: &Incoming,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Everything a consumer needs besides its handler.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// The endpoint it consumes.
    pub endpoint: Endpoint,
    /// Retry tiers and attempt cap.
    pub policy: RetryPolicy,
    /// Unacked deliveries at once (and, without batching, handled concurrently).
    pub prefetch: u16,
    /// How deliveries are grouped into transactions.
    pub batch: Batching,
    /// The broker.
    pub amqp_url: SecretUrl,
    /// Between reconnects (and between tries while the database is unreachable).
    pub reconnect: Backoff,
    /// Starts of a redelivered message, alone and never finished, before it is parked as the one
    /// crashing its consumer. Each is a process that died: a message is parked after at most
    /// `max_crashes + 1` crashes (the first may have been concurrent with others).
    pub max_crashes: u32,
    /// How long one handler transaction may run. A handler still running then is abandoned (its
    /// transaction rolls back): a database that answers a ping makes it a transient failure of the
    /// message, one that does not an outage (no attempt spent).
    pub handler_timeout: Duration,
    /// How long inbox rows are kept (`INBOX_RETENTION`): older ones are deleted hourly.
    pub inbox_retention: Duration,
}

impl ConsumerSettings {
    /// Settings for `endpoint` from a binary's flags: its retry, prefetch, crash and timeout flags,
    /// its broker, and the default reconnect backoff.
    pub fn from_args(endpoint: Endpoint, args: &ConsumerArgs, broker: &BrokerArgs) -> Self {
        Self {
            endpoint: Endpoint { delivery_limit: args.delivery_limit, ..endpoint },
            policy: args.retry_policy(),
            prefetch: args.prefetch,
            batch: Batching { max_size: usize::from(args.batch_size), max_wait: args.batch_wait },
            amqp_url: broker.amqp_url.clone(),
            reconnect: Backoff::default(),
            max_crashes: args.max_crashes,
            handler_timeout: args.handler_timeout,
            inbox_retention: args.inbox_retention,
        }
    }
}

/// Several ready deliveries applied in one transaction (one inbox row each, one commit, one
/// ack), one batch at a time. `max_size` 1 turns it off: each delivery is applied in its own
/// transaction, up to `prefetch` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Deliveries per transaction, at most.
    pub max_size: usize,
    /// How long a batch that is not full waits for more before it starts.
    pub max_wait: Duration,
}

impl Batching {
    /// One delivery per transaction.
    pub const OFF: Self = Self { max_size: 1, max_wait: Duration::ZERO };

    fn on(&self) -> bool {
        self.max_size > 1
    }
}

/// The name of an endpoint's consumer in `/readyz` (and in the broker's management UI). A service
/// sets it not ready before it serves `/readyz`, so that a probe that comes before the consumer
/// has started is not answered "ready".
pub fn readiness_flag(endpoint: &Endpoint) -> String {
    format!("consumer:{}", endpoint.name)
}

/// Run a consumer until shutdown: connect, declare the endpoint's topology, consume; on a lost
/// connection, reconnect with backoff and resume. Never returns early on a broker or database
/// failure: those are waited out.
pub async fn run<H: Handler>(
    settings: ConsumerSettings,
    handler: Arc<H>,
    pool: PgPool,
    health: Health,
    shutdown: Shutdown,
) {
    let name = settings.endpoint.name;
    let link = Link {
        url: settings.amqp_url.clone(),
        name: readiness_flag(&settings.endpoint),
        backoff: settings.reconnect,
        readiness: Arc::clone(&health.readiness),
    };
    let retention = settings.inbox_retention;
    let prune = crate::retention::run("inbox", shutdown.clone(), {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            async move { crate::inbox::delete_received_before(&pool, retention, crate::retention::BATCH).await }
        }
    });
    let metrics = health.metrics.endpoint(name);
    let mut runtime = Arc::new(Runtime { settings, handler, pool, health, metrics, flag: link.name.clone(), shutdown });
    let shutdown = runtime.shutdown.clone();
    async {
        let pruning = tokio::spawn(prune.in_current_span());
        broker::run_sessions(&link, &shutdown, &mut runtime).await;
        let _ = pruning.await;
        tracing::info!("consumer stopped");
    }
    .instrument(tracing::info_span!("consumer", endpoint = name))
    .await;
}

impl<H: Handler> Session for Arc<Runtime<H>> {
    fn run(&mut self, connection: &Connection) -> impl std::future::Future<Output = SessionEnd> + Send {
        self.session(connection)
    }
}

struct Runtime<H> {
    settings: ConsumerSettings,
    handler: Arc<H>,
    pool: PgPool,
    health: Health,
    /// Its endpoint's series, looked up once.
    metrics: EndpointMetrics,
    /// The readiness flag of its link.
    flag: String,
    shutdown: Shutdown,
}

/// The outcome of the transaction for one message.
#[derive(Debug, Clone, Copy)]
enum Applied {
    Done,
    Duplicate,
}

impl Applied {
    /// How its transaction ended, for `message_handling_duration_seconds`.
    fn handling(self) -> Handling {
        match self {
            Self::Done => Handling::Succeeded,
            Self::Duplicate => Handling::Duplicate,
        }
    }
}

impl<H: Handler> Runtime<H> {
    /// One connection's worth of consuming, until shutdown or until the connection fails.
    async fn session(self: &Arc<Self>, connection: &Connection) -> SessionEnd {
        let (endpoint, flag, shutdown) = (&self.settings.endpoint, self.flag.as_str(), &self.shutdown);
        let setup = async {
            let channel = connection.create_channel().await?;
            channel.basic_qos(self.settings.prefetch, BasicQosOptions::default()).await?;
            topology::declare_endpoint(&channel, endpoint, &self.settings.policy).await?;
            let publisher = Publisher::open(connection).await?;
            let tag = format!("{}-{}", endpoint.name, Uuid::new_v4());
            let deliveries = channel
                .basic_consume(
                    endpoint.name.into(),
                    tag.as_str().into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            // The intake of what the broker dead-letters has a channel of its own, so that the
            // work channel's delivery tags all come, in order, from the one work-queue stream: a
            // batch's multiple-ack can then never cover a delivery not yet seen ([`Acks`]).
            let dead_letter_channel = connection.create_channel().await?;
            dead_letter_channel.basic_qos(self.settings.prefetch, BasicQosOptions::default()).await?;
            let dead_letters = dead_letter_channel
                .basic_consume(
                    endpoint.dead_lettered_queue().as_str().into(),
                    format!("{tag}-dead-lettered").as_str().into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let channels = (Acks::new(channel), Acks::new(dead_letter_channel));
            Ok::<_, lapin::Error>((channels, publisher, tag, deliveries, dead_letters))
        };
        let ((acks, dead_letter_acks), publisher, tag, mut deliveries, mut dead_letters) = match setup.await {
            Ok(started) => started,
            Err(error) => {
                tracing::warn!(%error, "cannot start consuming; will reconnect");
                return SessionEnd::Lost { was_up: false };
            }
        };
        self.health.readiness.set(flag, true);
        tracing::info!(prefetch = self.settings.prefetch, "consuming");

        // Ends with the session (connection lost, or shutdown): deliveries still waiting for the
        // database then give up and are handed back, since a closed channel cannot ack them.
        let (end_session, session_ended) = crate::shutdown::channel();
        let mut in_flight = JoinSet::new();
        // A redelivery may be the message that crashed the last process, so it runs alone: it waits
        // here until nothing else is in flight, and nothing new starts until it has settled. Were it
        // to crash again, no other message's handler was running beside it (decision 0005).
        let mut waiting: Option<Delivery> = None;
        let mut alone = false;
        // Batching: deliveries received while a batch runs wait here for the next one, which
        // starts once the running batch has settled (and, if not full, `max_wait` has passed).
        let batching = self.settings.batch;
        let mut next_batch: Vec<Delivery> = Vec::new();
        let mut next_batch_due = tokio::time::Instant::now();
        let ended = loop {
            if in_flight.is_empty() && !next_batch.is_empty() {
                let full = next_batch.len() >= batching.max_size;
                if full || waiting.is_some() || tokio::time::Instant::now() >= next_batch_due {
                    let take = next_batch.len().min(batching.max_size);
                    let batch: Vec<Delivery> = next_batch.drain(..take).collect();
                    let (runtime, publisher) = (Arc::clone(self), publisher.clone());
                    in_flight.spawn(runtime.process_batch(batch, publisher, acks.clone(), session_ended.clone()));
                    next_batch_due = tokio::time::Instant::now() + batching.max_wait;
                }
            }
            if in_flight.is_empty() && next_batch.is_empty() {
                alone = false;
                if let Some(delivery) = waiting.take() {
                    let (runtime, publisher) = (Arc::clone(self), publisher.clone());
                    in_flight.spawn(runtime.process(delivery, publisher, acks.clone(), session_ended.clone()));
                    alone = true;
                }
            }
            let accepting = waiting.is_none() && !alone;
            let batch_waits = in_flight.is_empty() && !next_batch.is_empty();
            tokio::select! {
                () = shutdown.triggered() => break SessionEnd::Shutdown,
                Some(joined) = in_flight.join_next(), if !in_flight.is_empty() => {
                    if let Err(error) = flatten(joined) {
                        tracing::warn!(%error, "delivery could not be settled; reconnecting");
                        break SessionEnd::Lost { was_up: true };
                    }
                }
                () = tokio::time::sleep_until(next_batch_due), if batch_waits => {}
                next = deliveries.next(), if accepting => match next {
                    Some(Ok(delivery)) => {
                        acks.received(delivery.delivery_tag).await;
                        if delivery.redelivered {
                            waiting = Some(delivery);
                        } else if batching.on() {
                            if next_batch.is_empty() && in_flight.is_empty() {
                                next_batch_due = tokio::time::Instant::now() + batching.max_wait;
                            }
                            next_batch.push(delivery);
                            // Whatever else is ready joins it, up to a full batch.
                            while next_batch.len() < batching.max_size {
                                match deliveries.next().now_or_never() {
                                    Some(Some(Ok(delivery))) if delivery.redelivered => {
                                        acks.received(delivery.delivery_tag).await;
                                        waiting = Some(delivery);
                                        break;
                                    }
                                    Some(Some(Ok(delivery))) => {
                                        acks.received(delivery.delivery_tag).await;
                                        next_batch.push(delivery);
                                    }
                                    // An error or the end shows again on the next poll.
                                    _ => break,
                                }
                            }
                        } else {
                            let (runtime, publisher) = (Arc::clone(self), publisher.clone());
                            in_flight.spawn(runtime.process(delivery, publisher, acks.clone(), session_ended.clone()));
                        }
                    }
                    Some(Err(error)) => {
                        tracing::warn!(%error, "broker connection lost; reconnecting");
                        break SessionEnd::Lost { was_up: true };
                    }
                    None => {
                        tracing::warn!("consumer cancelled by the broker; reconnecting");
                        break SessionEnd::Lost { was_up: true };
                    }
                },
                next = dead_letters.next() => match next {
                    Some(Ok(delivery)) => {
                        dead_letter_acks.received(delivery.delivery_tag).await;
                        let (runtime, publisher) = (Arc::clone(self), publisher.clone());
                        in_flight.spawn(runtime.park_dead_lettered(delivery, publisher, dead_letter_acks.clone()));
                    }
                    Some(Err(error)) => {
                        tracing::warn!(%error, "broker connection lost; reconnecting");
                        break SessionEnd::Lost { was_up: true };
                    }
                    None => {
                        tracing::warn!("dead-letter consumer cancelled by the broker; reconnecting");
                        break SessionEnd::Lost { was_up: true };
                    }
                },
            }
        };

        // Stop new deliveries, then let every in-flight one finish and settle (commit, then ack)
        // before the channel closes; whatever was prefetched but not started, or was waiting for the
        // database, goes back to the queue when the channel closes. This is the only requeue the
        // runtime ever causes.
        //
        // Every broker call here is bounded: on a connection that has just died, lapin can queue a
        // request that is never answered. What is still in flight after the handler timeout (plus
        // time to settle) is abandoned: unacked, it comes back, and the inbox skips what committed.
        end_session.trigger();
        let dead_letter_tag = format!("{tag}-dead-lettered");
        for (channel, tag) in [(&acks.channel, tag.as_str()), (&dead_letter_acks.channel, dead_letter_tag.as_str())] {
            bounded(channel.basic_cancel(tag.into(), BasicCancelOptions::default())).await;
        }
        let drained = tokio::time::timeout(self.settings.handler_timeout + WIND_DOWN, async {
            while let Some(joined) = in_flight.join_next().await {
                if let Err(error) = flatten(joined) {
                    tracing::warn!(%error, "delivery left unacked; the broker will redeliver it");
                }
            }
        });
        if drained.await.is_err() {
            tracing::warn!(
                abandoned = in_flight.len(),
                "deliveries still in flight abandoned; the broker will redeliver them"
            );
            in_flight.abort_all();
        }
        bounded(async {
            publisher.close().await;
            Ok::<_, lapin::Error>(())
        })
        .await;
        bounded(acks.channel.close(200, "bye".into())).await;
        bounded(dead_letter_acks.channel.close(200, "bye".into())).await;
        ended
    }

    /// [`Self::handle_delivery`] inside the delivery's span.
    async fn process(
        self: Arc<Self>,
        delivery: Delivery,
        publisher: Publisher,
        acks: Arc<Acks>,
        session_ended: Shutdown,
    ) -> Result<(), PublishError> {
        let arrived = self.arrived(delivery);
        let handled = self
            .handle_delivery(InFlight(arrived.delivery, acks), arrived.decoded, publisher, session_ended)
            .instrument(arrived.span);
        trace::scope(arrived.context, handled).await
    }

    /// A delivery decoded once (the span is made from the decoded envelope, and the handling uses
    /// it), with its span and trace context. The span continues the trace the message carries (or
    /// starts one): what the handler writes to its outbox, and the job events about it, name this
    /// span as parent.
    fn arrived(&self, delivery: Delivery) -> Arrived {
        let endpoint = &self.settings.endpoint;
        let decoded = Incoming::decode(&delivery).and_then(|message| {
            endpoint.check(&message.message_type, message.version)?;
            Ok(message)
        });
        let traceparent = envelope::traceparent(&delivery.properties);
        let context = TraceContext::continuing(traceparent.as_deref());
        let span = delivery_span("delivery", endpoint.name, &delivery, decoded.as_ref().ok());
        context.record_on(&span);
        Arrived { delivery, decoded, context, span }
    }

    /// Apply a batch of deliveries (none redelivered) in one transaction, commit, and settle them
    /// with one ack. Should anything in it fail (a handler's error, an outage, the commit, the
    /// time limit), nothing of it commits and each message is applied again on its own, exactly
    /// as without batching: its retry, parking, attempt count and inbox row are what they would
    /// have been.
    async fn process_batch(
        self: Arc<Self>,
        deliveries: Vec<Delivery>,
        publisher: Publisher,
        acks: Arc<Acks>,
        session_ended: Shutdown,
    ) -> Result<(), PublishError> {
        let mut members = Vec::with_capacity(deliveries.len());
        for delivery in deliveries {
            match self.arrived(delivery) {
                Arrived { delivery, decoded: Ok(message), context, span } => {
                    members.push(Member { delivery, message, context, span });
                }
                // Unreadable: parked at once, as on its own.
                unreadable => {
                    let handled = self
                        .clone()
                        .handle_delivery(
                            InFlight(unreadable.delivery, acks.clone()),
                            unreadable.decoded,
                            publisher.clone(),
                            session_ended.clone(),
                        )
                        .instrument(unreadable.span);
                    trace::scope(unreadable.context, handled).await?;
                }
            }
        }
        if members.len() > 1 {
            let started = std::time::Instant::now();
            match self.apply_batch(&members).await {
                Ok(outcomes) => {
                    let tags: Vec<u64> = members.iter().map(|member| member.delivery.delivery_tag).collect();
                    acks.ack_all(&tags).await?;
                    let seconds = started.elapsed().as_secs_f64();
                    for (member, applied) in members.iter().zip(outcomes) {
                        member.span.in_scope(|| {
                            self.metrics.handling(applied.handling(), seconds);
                            self.acked(applied);
                        });
                    }
                    return Ok(());
                }
                Err(error) => {
                    tracing::info!(messages = members.len(), %error, "batch not applied; applying its messages one by one");
                }
            }
        }
        for Member { delivery, message, context, span } in members {
            let settled = self.settle(InFlight(delivery, acks.clone()), &publisher, &message, &session_ended);
            trace::scope(context, settled.instrument(span)).await?;
        }
        Ok(())
    }

    /// Inbox rows (one statement for the batch), handlers and one commit for the whole batch,
    /// within `handler_timeout`: all or nothing. Each handler runs in its message's span and trace
    /// context, so the outbox rows it writes continue that message's trace.
    async fn apply_batch(&self, members: &[Member]) -> Result<Vec<Applied>, HandlerError> {
        let all = async {
            let mut tx = self.pool.begin().await?;
            let messages: Vec<(Uuid, &str)> = members
                .iter()
                .map(|member| (member.message.message_id, member.message.message_type.as_str()))
                .collect();
            let new = inbox::record_all(&mut tx, &messages, self.settings.endpoint.name).await?;
            let mut outcomes = Vec::with_capacity(members.len());
            for (member, new) in members.iter().zip(new) {
                if !new {
                    outcomes.push(Applied::Duplicate);
                    continue;
                }
                let handled = self.handler.handle(&member.message, &mut tx).instrument(member.span.clone());
                trace::scope(member.context, handled).await?;
                outcomes.push(Applied::Done);
            }
            commit(tx).await?;
            Ok(outcomes)
        };
        let limit = self.settings.handler_timeout;
        tokio::time::timeout(limit, all).await.unwrap_or_else(|_| {
            Err(HandlerError::Transient(format!("the batch did not finish within {}", format_duration(limit))))
        })
    }

    /// Handle one delivery from arrival to ack. An error means the delivery could not be settled
    /// (the broker connection failed): it stays unacked and comes back on the next session.
    async fn handle_delivery(
        self: Arc<Self>,
        delivery: InFlight,
        decoded: Result<Incoming, Unreadable>,
        publisher: Publisher,
        session_ended: Shutdown,
    ) -> Result<(), PublishError> {
        let redelivered = delivery.0.redelivered;
        let endpoint = &self.settings.endpoint;
        let message = match decoded {
            Ok(message) => message,
            Err(unreadable) => {
                let retry_count = envelope::retry_count(&delivery.0);
                return self.park(delivery, &publisher, retry_count, &unreadable.to_string()).await;
            }
        };
        if !redelivered {
            return self.settle(delivery, &publisher, &message, &session_ended).await;
        }

        // A redelivery, running alone. Commit its start before the handler runs: if this process
        // dies now, the count stays, and the next process sees how often it has done so.
        let endpoint = endpoint.name;
        let starts = self
            .when_reachable(&session_ended, || async {
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
                self.park(delivery, &publisher, message.retry_count, &reason).await?;
                Ok(())
            }
            Some(Ok(_)) => self.settle(delivery, &publisher, &message, &session_ended).await,
            // The ledger itself fails (not an outage): handle the message; the broker's delivery
            // limit remains the crash net.
            Some(Err(error)) => {
                tracing::warn!(%error, "crash ledger unavailable");
                self.settle(delivery, &publisher, &message, &session_ended).await
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

    /// Apply a readable message and settle its delivery by the outcome: ack, retry or park.
    async fn settle(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        message: &Incoming,
        session_ended: &Shutdown,
    ) -> Result<(), PublishError> {
        match self.when_reachable(session_ended, || self.apply(message)).await {
            None => {
                tracing::info!("session ended during a database outage; the broker will redeliver");
                return Ok(());
            }
            Some(Ok(applied)) => {
                delivery.ack().await?;
                self.acked(applied);
            }
            // `Unavailable` is waited out above; were one to get here, it would be retried.
            Some(Err(HandlerError::Transient(error) | HandlerError::Unavailable(error))) => {
                match self.settings.policy.next_delay(message.retry_count) {
                    Some(delay) => self.retry(delivery, publisher, message, delay, &error).await?,
                    None => {
                        let reason = format!("gave up after {} attempts: {error}", message.attempt());
                        self.park(delivery, publisher, message.retry_count, &reason).await?;
                    }
                }
            }
            Some(Err(HandlerError::Permanent(error))) => {
                self.park(delivery, publisher, message.retry_count, &error).await?
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
        loop {
            match work().await {
                Err(HandlerError::Unavailable(error)) => {
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

    /// [`Self::apply_unbounded`] within `handler_timeout`. An abandoned transaction rolls back with
    /// its connection; whose fault the wait was decides what it costs.
    async fn apply(&self, message: &Incoming) -> Result<Applied, HandlerError> {
        let started = std::time::Instant::now();
        let applied = self.apply_within_timeout(message).await;
        let outcome = match &applied {
            Ok(applied) => applied.handling(),
            Err(HandlerError::Unavailable(_)) => Handling::Unavailable,
            Err(_) => Handling::Failed,
        };
        self.metrics.handling(outcome, started.elapsed().as_secs_f64());
        applied
    }

    async fn apply_within_timeout(&self, message: &Incoming) -> Result<Applied, HandlerError> {
        let limit = self.settings.handler_timeout;
        match tokio::time::timeout(limit, self.apply_unbounded(message)).await {
            Ok(outcome) => outcome,
            Err(_) if db::answers(&self.pool).await => {
                Err(HandlerError::Transient(format!("the handler did not finish within {}", format_duration(limit))))
            }
            Err(_) => {
                Err(HandlerError::Unavailable(format!("the database did not answer within {}", format_duration(limit))))
            }
        }
    }

    /// Inbox row, handler, commit: all or nothing.
    async fn apply_unbounded(&self, message: &Incoming) -> Result<Applied, HandlerError> {
        let mut tx = self.pool.begin().await?;
        let applied = self.record_and_handle(&mut tx, message).await?;
        // A duplicate changed nothing: its transaction rolls back.
        if let Applied::Done = applied {
            commit(tx).await?;
        }
        Ok(applied)
    }

    /// The inbox row and the handler's effect for `message`, in `tx`, not committed; `Duplicate`
    /// (and nothing done) if the inbox has seen it.
    async fn record_and_handle(&self, tx: &mut PgConnection, message: &Incoming) -> Result<Applied, HandlerError> {
        let endpoint = self.settings.endpoint.name;
        if !inbox::record(tx, message.message_id, &message.message_type, endpoint).await? {
            return Ok(Applied::Duplicate);
        }
        self.handler.handle(message, tx).await?;
        Ok(Applied::Done)
    }

    /// Count a delivery acked after its transaction: applied, or skipped by the inbox.
    fn acked(&self, applied: Applied) {
        match applied {
            Applied::Done => self.count(Handled::Succeeded),
            Applied::Duplicate => {
                self.count(Handled::Duplicate);
                self.metrics.duplicate();
                tracing::info!("duplicate skipped by the inbox");
            }
        }
    }

    /// Re-publish a copy to the wait tier for `delay`, then ack the original. The copy goes to the
    /// wait queue by name and comes back to this endpoint's work queue only.
    async fn retry(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        message: &Incoming,
        delay: std::time::Duration,
        error: &str,
    ) -> Result<(), PublishError> {
        let endpoint = &self.settings.endpoint;
        let next_retry = i64::from(message.retry_count) + 1;
        let properties = envelope::with_headers(
            &delivery.0.properties,
            &[(envelope::HEADER_RETRY_COUNT, AMQPValue::LongLongInt(next_retry))],
        );
        let copy = publisher.send("", &endpoint.wait_queue(delay), &delivery.0.data, properties).await?;
        let event = message.correlation_id.map(|job_id| JobRetryScheduled {
            job_id,
            endpoint: endpoint.name.to_owned(),
            message_id: message.message_id,
            message_type: message.message_type.clone(),
            attempt: message.attempt(),
            next_attempt: message.attempt() + 1,
            next_attempt_at: Utc::now() + delay,
            error: error.to_owned(),
        });
        let event = self.send_event(publisher, event).await;
        copy.confirmed().await?;
        self.settle_event(event).await;
        delivery.ack().await?;
        self.count(Handled::Retried);
        tracing::warn!(?delay, error, "transient failure; retry scheduled");
        Ok(())
    }

    /// Publish the delivery, untouched but for our headers, to the parking queue; then ack it.
    async fn park(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        retry_count: u32,
        reason: &str,
    ) -> Result<(), PublishError> {
        let endpoint = &self.settings.endpoint;
        let properties = &delivery.0.properties;
        let parked_properties = envelope::with_headers(
            properties,
            &[
                (envelope::HEADER_LAST_ERROR, envelope::string_value(reason)),
                (envelope::HEADER_RETRY_COUNT, AMQPValue::LongLongInt(i64::from(retry_count))),
                (envelope::HEADER_ENDPOINT, envelope::string_value(endpoint.name)),
                (envelope::HEADER_PARKED_AT, envelope::string_value(&Utc::now().to_rfc3339())),
            ],
        );
        let parked = publisher.send("", &endpoint.parking_queue(), &delivery.0.data, parked_properties).await?;
        let event = envelope::correlation_id(properties).map(|job_id| JobQuarantined {
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
        self.settle_event(event).await;
        delivery.ack().await?;
        self.count(Handled::Parked);
        tracing::error!(reason, "message parked");
        Ok(())
    }

    /// Park a message the broker dead-letters from the work queue (its delivery limit): with the
    /// broker's reason, our headers only, and a `job.quarantined` event, so that its job ends too.
    async fn park_dead_lettered(
        self: Arc<Self>,
        delivery: Delivery,
        publisher: Publisher,
        acks: Arc<Acks>,
    ) -> Result<(), PublishError> {
        let span = delivery_span("dead_letter", self.settings.endpoint.name, &delivery, None);
        let reason =
            envelope::broker_death(&delivery.properties).unwrap_or_else(|| "dead-lettered by the broker".into());
        let retry_count = envelope::retry_count(&delivery);
        self.park(InFlight(delivery, acks), &publisher, retry_count, &reason).instrument(span).await
    }

    /// Send a `job.*` event (pipelined with the retry or park publish it reports).
    async fn send_event<C: JobEvent>(
        &self,
        publisher: &Publisher,
        event: Option<C>,
    ) -> Option<crate::publisher::Pending> {
        let event = event?;
        let body = serde_json::to_vec(&event).ok()?;
        let properties: BasicProperties =
            Headers::of::<C>(Some(event.job_id())).properties(Uuid::now_v7(), C::TYPE, Utc::now());
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
    async fn settle_event(&self, pending: Option<crate::publisher::Pending>) {
        if let Some(pending) = pending
            && let Err(error) = pending.confirmed().await
        {
            tracing::warn!(%error, "job event not confirmed");
        }
    }

    fn count(&self, outcome: Handled) {
        self.metrics.handled(outcome);
        let span = tracing::Span::current();
        span.record("outcome", outcome.as_str());
        if matches!(outcome, Handled::Retried | Handled::Parked) {
            // A failed attempt: its exported span shows as an error (`crate::otel`).
            span.record("otel.status_code", "error");
        }
        // In the delivery's span: with its trace and span ids, for whoever follows a trace in logs.
        tracing::debug!(outcome = outcome.as_str(), "delivery settled");
    }
}

/// The span of one delivery: every line logged while handling it, the handler's included, carries
/// the endpoint, the message's id, type and attempt, and its job. Taken from `message` when the
/// envelope decoded (the usual case: nothing is parsed twice), else from the raw properties.
fn delivery_span(kind: &'static str, endpoint: &str, delivery: &Delivery, message: Option<&Incoming>) -> tracing::Span {
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

/// How long a best-effort broker call at the end of a session may take.
const WIND_DOWN: Duration = Duration::from_secs(5);

/// A best-effort broker call, given up after [`WIND_DOWN`]: its outcome changes nothing.
async fn bounded<T>(call: impl Future<Output = lapin::Result<T>>) -> Option<T> {
    tokio::time::timeout(WIND_DOWN, call).await.ok()?.ok()
}

/// Commit a message's (or a batch's) transaction, between the workers' two failpoints.
async fn commit(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), HandlerError> {
    failpoint::hit(failpoint::WORKER_BEFORE_COMMIT).await;
    tx.commit().await?;
    failpoint::hit(failpoint::WORKER_AFTER_COMMIT).await;
    Ok(())
}

/// A delivery not yet settled, and its channel's [`Acks`]. Its only ways out consume it, so it is
/// settled at most once.
struct InFlight(Delivery, Arc<Acks>);

impl InFlight {
    /// Ack: the outcome (commit, retry copy, parked copy) is already durable.
    async fn ack(self) -> Result<(), PublishError> {
        self.1.ack(self.0.delivery_tag).await?;
        Ok(())
    }
}

/// A delivery as it arrived: decoded (or not), with its span and trace context.
struct Arrived {
    delivery: Delivery,
    decoded: Result<Incoming, Unreadable>,
    context: TraceContext,
    span: tracing::Span,
}

/// A readable delivery in a batch.
struct Member {
    delivery: Delivery,
    message: Incoming,
    context: TraceContext,
    span: tracing::Span,
}

/// The deliveries of one channel that are not yet settled. Every ack of the channel goes through
/// here, in order, so that a batch is settled with one `basic.ack(multiple)` only when that
/// settles exactly its own deliveries: when no delivery with a smaller tag is still unsettled.
/// (The tags of a channel grow in the order its deliveries arrive, and each is recorded here
/// before it is handled; the work channel has one consumer, so none can arrive out of order.)
/// Otherwise, it acks each of its deliveries.
struct Acks {
    channel: lapin::Channel,
    unsettled: tokio::sync::Mutex<BTreeSet<u64>>,
}

impl Acks {
    fn new(channel: lapin::Channel) -> Arc<Self> {
        Arc::new(Self { channel, unsettled: tokio::sync::Mutex::default() })
    }

    /// A delivery arrived.
    async fn received(&self, tag: u64) {
        self.unsettled.lock().await.insert(tag);
    }

    /// Ack one delivery.
    async fn ack(&self, tag: u64) -> lapin::Result<()> {
        let mut unsettled = self.unsettled.lock().await;
        self.channel.basic_ack(tag, BasicAckOptions::default()).await?;
        unsettled.remove(&tag);
        Ok(())
    }

    /// Ack these deliveries: with one `multiple` ack if nothing before the last is unsettled.
    async fn ack_all(&self, tags: &[u64]) -> lapin::Result<()> {
        let Some(&last) = tags.iter().max() else { return Ok(()) };
        let mut unsettled = self.unsettled.lock().await;
        for tag in tags {
            unsettled.remove(tag);
        }
        if unsettled.range(..last).next().is_none() {
            return self.channel.basic_ack(last, BasicAckOptions { multiple: true }).await;
        }
        for &tag in tags {
            self.channel.basic_ack(tag, BasicAckOptions::default()).await?;
        }
        Ok(())
    }
}

fn flatten(joined: Result<Result<(), PublishError>, tokio::task::JoinError>) -> Result<(), String> {
    match joined {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error.to_string()),
        // A handler that panics leaves its delivery unacked and ends the session; the delivery
        // comes back redelivered, and the crash bound parks a message that keeps doing it.
        Err(join_error) => Err(format!("handler task failed: {join_error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::HandlerError;

    #[test]
    fn database_errors_are_classified_by_whose_fault_they_are() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(matches!(HandlerError::from(sqlx::Error::Io(refused)), HandlerError::Unavailable(_)));
        assert!(matches!(HandlerError::from(sqlx::Error::PoolTimedOut), HandlerError::Unavailable(_)));
        assert!(matches!(HandlerError::from(sqlx::Error::Protocol("garbled".into())), HandlerError::Transient(_)));
        assert!(matches!(HandlerError::from(sqlx::Error::RowNotFound), HandlerError::Permanent(_)));
    }
}
