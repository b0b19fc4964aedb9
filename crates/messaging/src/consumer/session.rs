//! One connection's worth of consuming: open the channels, run the [`Scheduler`]'s decisions
//! until shutdown or a lost connection, then wind down. The I/O is here; what to start when is
//! the scheduler's.
//!
//! What the consumer publishes (retry, parked and deferred copies, `job.*` events) goes over a
//! connection of its own. Under a resource alarm RabbitMQ stops reading from a connection once it
//! publishes, and lapin then writes nothing on it either: on the consuming connection, that would
//! stop the acks, freezing the consumer with its prefetch pinned, although consuming is what
//! clears a memory alarm. And a settlement that needs a publish is held beside the session's
//! other work ([`Io::hold`]), so that while the broker blocks publishing, the deliveries that need
//! none are still applied and acked; the held ones wait, up to `CONFIRM_TIMEOUT`.

use std::{
    future::Future,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::{FutureExt, StreamExt};
use lapin::{
    Connection,
    message::Delivery,
    options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use messaging_core::trace;
use tokio::{task::JoinSet, time::Instant};
use uuid::Uuid;

use super::{
    Handler, Runtime,
    acks::{Acks, InFlight},
    probe,
    scheduler::{Scheduler, Start},
};
use crate::{
    publisher::{PublishError, Publisher},
    runtime::{
        broker::{self, Session, SessionEnd},
        shutdown::{self, Shutdown},
    },
    topology,
};

impl<H: Handler> Session for Arc<Runtime<H>> {
    fn run(&mut self, connection: &Connection, node: usize) -> impl Future<Output = SessionEnd> + Send {
        self.session(connection, node)
    }
}

/// What every task of a session settles through: its publisher (retry and parked copies, job
/// events), the session's end, at which a task still waiting for the database gives up, and the
/// settlements held beside the session's work ([`Io::hold`]).
#[derive(Clone)]
pub(super) struct Io {
    pub(super) publisher: Publisher,
    pub(super) ended: Shutdown,
    held: Arc<Mutex<Tasks>>,
}

impl Io {
    /// Run `settlement` (a copy published, its confirm awaited, then the ack) beside the
    /// session's other work rather than inside the task that applied the delivery: the task ends,
    /// the next batch starts, and a broker that blocks publishing holds only the deliveries that
    /// need a publish. Its error ends the session, as any settlement's does. In the current
    /// trace context, as if awaited here.
    pub(super) fn hold(&self, settlement: impl Future<Output = Result<(), PublishError>> + Send + 'static) {
        let settlement = tracing::Instrument::in_current_span(settlement);
        // Taken here: the task it runs in has no trace context of its own.
        let context = trace::current();
        let settlement = async move {
            match context {
                Some(context) => trace::scope(context, settlement).await,
                None => settlement.await,
            }
        };
        lock(&self.held).spawn(settlement);
    }
}

/// A session's channels and consumers.
struct Opened {
    /// The work queue's channel.
    work: Arc<Acks>,
    deliveries: lapin::Consumer,
    /// The intake of what the broker dead-letters, on a channel of its own, so that the work
    /// channel's delivery tags all come, in order, from the one work-queue stream: a batch's
    /// multiple-ack can then never cover a delivery not yet seen ([`Acks`]).
    intake: Arc<Acks>,
    dead_letters: lapin::Consumer,
    publisher: Publisher,
    /// The connection `publisher` and the probe ([`probe`]) are on: not the consuming one.
    publishing: Arc<Connection>,
    tag: String,
}

/// The tasks of a session: each settles one delivery or one batch.
type Tasks = JoinSet<Result<(), PublishError>>;

impl<H: Handler> Runtime<H> {
    /// One connection's worth of consuming, until shutdown or until the connection fails.
    async fn session(self: &Arc<Self>, connection: &Connection, node: usize) -> SessionEnd {
        let mut opened = match self.open(connection, node).await {
            Ok(opened) => opened,
            Err(error) => {
                tracing::warn!(%error, "cannot start consuming; will reconnect");
                return SessionEnd::Lost { was_up: false };
            }
        };
        self.health.readiness.set(&self.flag, true);
        self.metrics.session_started();
        tracing::info!(prefetch = self.settings.prefetch, "consuming");

        // Ends with the session (connection lost, or shutdown): deliveries still waiting for the
        // database then give up and are handed back, since a closed channel cannot ack them.
        let (end_session, ended) = shutdown::channel();
        let io = Io { publisher: opened.publisher.clone(), ended, held: Arc::default() };
        let mut tasks = JoinSet::new();
        let watching = broker::watch_blocked(&opened.publishing, self.publishing_flag(), &self.health.readiness);
        let settings = &self.settings;
        let (readiness, flag) = (Arc::clone(&self.health.readiness), self.flag.clone());
        let probing =
            probe::spawn(Arc::clone(&opened.publishing), &settings.endpoint, settings.confirm_timeout, readiness, flag);
        let end = self.consume(&mut opened, &io, &mut tasks).await;
        end_session.trigger();
        probing.abort();
        self.wind_down(opened, tasks, &io).await;
        watching.abort();
        self.health.readiness.set_blocked(&self.publishing_flag(), None);
        end
    }

    /// The name of the session's publishing connection, in the broker's management UI and in
    /// `/readyz`'s blocked connections.
    fn publishing_flag(&self) -> String {
        format!("{}:publishing", self.flag)
    }

    /// Declare the endpoint's topology, connect for publishing (to the consuming connection's
    /// `node` first), and start both consumers.
    async fn open(&self, connection: &Connection, node: usize) -> lapin::Result<Opened> {
        let endpoint = &self.settings.endpoint;
        topology::declare_endpoint(connection, endpoint, &self.settings.policy).await?;
        let channel = connection.create_channel().await?;
        channel.basic_qos(self.settings.prefetch, BasicQosOptions::default()).await?;
        let (publishing, _) = broker::connect_any(&self.settings.amqp_url, node, &self.publishing_flag()).await?;
        let publisher = Publisher::open(&publishing).await?.with_confirm_timeout(self.settings.confirm_timeout);
        let tag = format!("{}-{}", endpoint.name, Uuid::new_v4());
        let consume = BasicConsumeOptions::default();
        let deliveries =
            channel.basic_consume(endpoint.name.into(), tag.as_str().into(), consume, FieldTable::default()).await?;
        let intake = connection.create_channel().await?;
        intake.basic_qos(self.settings.prefetch, BasicQosOptions::default()).await?;
        let dead_letters = intake
            .basic_consume(
                endpoint.dead_lettered_queue().as_str().into(),
                dead_letter_tag(&tag).as_str().into(),
                consume,
                FieldTable::default(),
            )
            .await?;
        Ok(Opened {
            work: Acks::new(channel),
            deliveries,
            intake: Acks::new(intake),
            dead_letters,
            publisher,
            publishing: Arc::new(publishing),
            tag,
        })
    }

    /// Take deliveries and start what the scheduler says, until shutdown or a lost connection.
    async fn consume(self: &Arc<Self>, opened: &mut Opened, io: &Io, tasks: &mut Tasks) -> SessionEnd {
        let mut scheduler = Scheduler::new(self.settings.batch, Instant::now());
        loop {
            if let Some(start) = scheduler.next(Instant::now()) {
                self.start(start, io, tasks);
            }
            debug_assert_eq!(scheduler.in_flight(), tasks.len());
            let wake_at = scheduler.wake_at();
            // A held settlement is only ever added by a task, whose end wakes this loop.
            let holding = !lock(&io.held).is_empty();
            tokio::select! {
                () = self.shutdown.triggered() => return SessionEnd::Shutdown,
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    scheduler.finished();
                    if let Err(error) = flatten(joined) {
                        tracing::warn!(%error, "delivery could not be settled; reconnecting");
                        return SessionEnd::Lost { was_up: true };
                    }
                }
                Some(joined) = std::future::poll_fn(|cx| lock(&io.held).poll_join_next(cx)), if holding => {
                    if let Err(error) = flatten(joined) {
                        tracing::warn!(%error, "delivery could not be settled; reconnecting");
                        return SessionEnd::Lost { was_up: true };
                    }
                }
                () = tokio::time::sleep_until(wake_at.unwrap_or_else(Instant::now)), if wake_at.is_some() => {}
                next = opened.deliveries.next(), if scheduler.accepting() => match next {
                    Some(Ok(delivery)) => {
                        self.receive(&mut scheduler, &opened.work, delivery, io, tasks).await;
                        // Whatever else is ready joins a gathering batch, up to a full one.
                        while scheduler.wants_more() {
                            // An error or the end shows again on the next poll.
                            let Some(Some(Ok(delivery))) = opened.deliveries.next().now_or_never() else { break };
                            self.receive(&mut scheduler, &opened.work, delivery, io, tasks).await;
                        }
                    }
                    Some(Err(error)) => return lost("broker connection lost", Some(error)),
                    None => return lost("consumer cancelled by the broker", None),
                },
                next = opened.dead_letters.next() => match next {
                    Some(Ok(delivery)) => {
                        let delivery = opened.intake.received(delivery).await;
                        scheduler.started_other();
                        tasks.spawn(Arc::clone(self).park_dead_lettered(delivery, io.clone()));
                    }
                    Some(Err(error)) => return lost("broker connection lost", Some(error)),
                    None => return lost("dead-letter consumer cancelled by the broker", None),
                },
            }
        }
    }

    /// A work-queue delivery arrived: record it, and start it if the scheduler says so.
    async fn receive(
        self: &Arc<Self>,
        scheduler: &mut Scheduler<InFlight>,
        work: &Arc<Acks>,
        delivery: Delivery,
        io: &Io,
        tasks: &mut Tasks,
    ) {
        let redelivered = delivery.redelivered;
        let delivery = work.received(delivery).await;
        if let Some(start) = scheduler.received(delivery, redelivered, Instant::now()) {
            self.start(start, io, tasks);
        }
    }

    fn start(self: &Arc<Self>, start: Start<InFlight>, io: &Io, tasks: &mut Tasks) {
        let runtime = Arc::clone(self);
        match start {
            Start::One(delivery) | Start::Alone(delivery) => tasks.spawn(runtime.process(delivery, io.clone())),
            Start::Batch(batch) => tasks.spawn(runtime.process_batch(batch, io.clone())),
        };
    }

    /// Stop new deliveries, then let every in-flight one finish and settle (commit, then ack)
    /// before the channels close; whatever was prefetched but not started, or was waiting for the
    /// database, goes back to the queue when the channel closes. This is the only requeue the
    /// runtime ever causes.
    ///
    /// Every broker call here is bounded: on a connection that has just died, lapin can queue a
    /// request that is never answered. What is still in flight after the handler timeout (plus
    /// time to settle) is abandoned: unacked, it comes back, and the inbox skips what committed.
    async fn wind_down(&self, opened: Opened, mut tasks: Tasks, io: &Io) {
        let Opened { work, intake, publisher, publishing, tag, .. } = opened;
        for (channel, tag) in [(&work.channel, tag.clone()), (&intake.channel, dead_letter_tag(&tag))] {
            bounded(channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default())).await;
        }
        // The tasks first (they may still hold a settlement), then the held settlements.
        let drained = tokio::time::timeout(self.settings.handler_timeout + WIND_DOWN, async {
            while let Some(joined) = tasks.join_next().await {
                if let Err(error) = flatten(joined) {
                    tracing::warn!(%error, "delivery left unacked; the broker will redeliver it");
                }
            }
            while let Some(joined) = std::future::poll_fn(|cx| lock(&io.held).poll_join_next(cx)).await {
                if let Err(error) = flatten(joined) {
                    tracing::warn!(%error, "delivery left unacked; the broker will redeliver it");
                }
            }
        });
        if drained.await.is_err() {
            let held = lock(&io.held).len();
            tracing::warn!(
                abandoned = tasks.len() + held,
                "deliveries still in flight abandoned; the broker will redeliver them"
            );
            tasks.abort_all();
            lock(&io.held).abort_all();
        }
        // A blocked connection writes nothing, its close included: dropped, its close is queued
        // and goes out when the alarm clears, instead of holding the next session for the bound.
        if !publishing.status().blocked() {
            bounded(async {
                publisher.close().await;
                Ok::<_, lapin::Error>(())
            })
            .await;
            bounded(publishing.close(200, "bye".into())).await;
        }
        bounded(work.channel.close(200, "bye".into())).await;
        bounded(intake.channel.close(200, "bye".into())).await;
    }
}

/// A poisoned lock only means a panic elsewhere while it was held; the set is still whole.
fn lock(held: &Mutex<Tasks>) -> std::sync::MutexGuard<'_, Tasks> {
    held.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn dead_letter_tag(tag: &str) -> String {
    format!("{tag}-dead-lettered")
}

/// The session ends because `what` happened to its connection or a consumer.
fn lost(what: &str, error: Option<lapin::Error>) -> SessionEnd {
    match error {
        Some(error) => tracing::warn!(%error, "{what}; reconnecting"),
        None => tracing::warn!("{what}; reconnecting"),
    }
    SessionEnd::Lost { was_up: true }
}

/// How long a best-effort broker call at the end of a session may take.
const WIND_DOWN: Duration = Duration::from_secs(5);

/// A best-effort broker call, given up after [`WIND_DOWN`]: its outcome changes nothing.
async fn bounded<T>(call: impl Future<Output = lapin::Result<T>>) -> Option<T> {
    tokio::time::timeout(WIND_DOWN, call).await.ok()?.ok()
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
