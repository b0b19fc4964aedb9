//! One connection's worth of consuming: open the channels, run the [`Scheduler`]'s decisions
//! until shutdown or a lost connection, then wind down. The I/O is here; what to start when is
//! the scheduler's.

use std::{future::Future, sync::Arc, time::Duration};

use futures_util::{FutureExt, StreamExt};
use lapin::{
    Connection,
    message::Delivery,
    options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use tokio::{task::JoinSet, time::Instant};
use uuid::Uuid;

use super::{
    Handler, Runtime,
    acks::{Acks, InFlight},
    scheduler::{Scheduler, Start},
};
use crate::{
    publisher::{PublishError, Publisher},
    runtime::{
        broker::{Session, SessionEnd},
        shutdown::{self, Shutdown},
    },
    topology,
};

impl<H: Handler> Session for Arc<Runtime<H>> {
    fn run(&mut self, connection: &Connection) -> impl Future<Output = SessionEnd> + Send {
        self.session(connection)
    }
}

/// What every task of a session settles through: its publisher (retry and parked copies, job
/// events), and the session's end, at which a task still waiting for the database gives up.
#[derive(Clone)]
pub(super) struct Io {
    pub(super) publisher: Publisher,
    pub(super) ended: Shutdown,
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
    tag: String,
}

/// The tasks of a session: each settles one delivery or one batch.
type Tasks = JoinSet<Result<(), PublishError>>;

impl<H: Handler> Runtime<H> {
    /// One connection's worth of consuming, until shutdown or until the connection fails.
    async fn session(self: &Arc<Self>, connection: &Connection) -> SessionEnd {
        let mut opened = match self.open(connection).await {
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
        let io = Io { publisher: opened.publisher.clone(), ended };
        let mut tasks = JoinSet::new();
        let end = self.consume(&mut opened, &io, &mut tasks).await;
        end_session.trigger();
        self.wind_down(opened, tasks).await;
        end
    }

    /// Declare the endpoint's topology and start both consumers.
    async fn open(&self, connection: &Connection) -> lapin::Result<Opened> {
        let endpoint = &self.settings.endpoint;
        let channel = connection.create_channel().await?;
        channel.basic_qos(self.settings.prefetch, BasicQosOptions::default()).await?;
        topology::declare_endpoint(&channel, endpoint, &self.settings.policy).await?;
        let publisher = Publisher::open(connection).await?.with_confirm_timeout(self.settings.confirm_timeout);
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
        Ok(Opened { work: Acks::new(channel), deliveries, intake: Acks::new(intake), dead_letters, publisher, tag })
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
            tokio::select! {
                () = self.shutdown.triggered() => return SessionEnd::Shutdown,
                Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                    scheduler.finished();
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
    async fn wind_down(&self, opened: Opened, mut tasks: Tasks) {
        let Opened { work, intake, publisher, tag, .. } = opened;
        for (channel, tag) in [(&work.channel, tag.clone()), (&intake.channel, dead_letter_tag(&tag))] {
            bounded(channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default())).await;
        }
        let drained = tokio::time::timeout(self.settings.handler_timeout + WIND_DOWN, async {
            while let Some(joined) = tasks.join_next().await {
                if let Err(error) = flatten(joined) {
                    tracing::warn!(%error, "delivery left unacked; the broker will redeliver it");
                }
            }
        });
        if drained.await.is_err() {
            tracing::warn!(
                abandoned = tasks.len(),
                "deliveries still in flight abandoned; the broker will redeliver them"
            );
            tasks.abort_all();
        }
        bounded(async {
            publisher.close().await;
            Ok::<_, lapin::Error>(())
        })
        .await;
        bounded(work.channel.close(200, "bye".into())).await;
        bounded(intake.channel.close(200, "bye".into())).await;
    }
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
