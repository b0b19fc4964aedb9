//! One connection's worth of consuming: open the channels, feed the [`Machine`] what happens and
//! start what it asks for, until shutdown or a lost connection, then wind down. The I/O is here;
//! what to start when is the machine's.
//!
//! What the consumer publishes (retry, parked and deferred copies, `job.*` events) goes over a
//! connection of its own. Under a resource alarm RabbitMQ stops reading from a connection once it
//! publishes, and lapin then writes nothing on it either: on the consuming connection, that would
//! stop the acks, freezing the consumer with its prefetch pinned, although consuming is what
//! clears a memory alarm. And a settlement that needs a publish is held beside the session's
//! other work ([`Io::hold`]), so that while the broker blocks publishing, the deliveries that need
//! none are still applied and acked; the held ones wait, up to `CONFIRM_TIMEOUT`.

use std::{
    collections::HashMap,
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
use tracing::Instrument;
use uuid::Uuid;

use super::{
    Handler, Runtime,
    acks::Acks,
    machine::{Action, Input, Machine, Tag},
    now, probe,
    settle::{Body, Done},
};
use crate::{
    publisher::{PublishError, Publisher},
    runtime::{
        broker::{self, Session, SessionEnd},
        metrics::Held,
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
    consumers: Consumers,
    publisher: Publisher,
    /// The connection `publisher` and the probe ([`probe`]) are on: not the consuming one.
    publishing: Arc<Connection>,
}

/// The session's two consumers, each on a channel of its own, opened again when they idle
/// ([`Runtime::renew`]).
struct Consumers {
    /// The work queue's channel.
    work: Arc<Acks>,
    deliveries: lapin::Consumer,
    /// The intake of what the broker dead-letters, on a channel of its own, so that the work
    /// channel's delivery tags all come, in order, from the one work-queue stream: a batch's
    /// multiple-ack can then never cover a delivery not yet seen ([`Acks`]).
    intake: Arc<Acks>,
    dead_letters: lapin::Consumer,
    tag: String,
}

/// The settlements a session holds beside its work ([`Io::hold`]).
type Tasks = JoinSet<Result<(), PublishError>>;

/// A session's side of its [`Machine`]: the deliveries the machine tracks, those counted as held
/// for their database, and the effects running.
struct Driver {
    machine: Machine,
    bodies: HashMap<Tag, Body>,
    held: HashMap<Tag, Held>,
    effects: JoinSet<Done>,
}

impl Driver {
    /// An effect ended: take back its bodies and feed the machine what it came to. An error is
    /// why the session must end.
    fn finished(&mut self, joined: Result<Done, tokio::task::JoinError>) -> Result<(), String> {
        let done = match joined {
            Ok(done) => done,
            // Only an abort at the end of the wind-down cancels an effect.
            Err(join_error) => return Err(format!("effect cancelled: {join_error}")),
        };
        if let Input::Panicked(tags) = &done.input {
            for tag in tags {
                self.held.remove(tag);
            }
        }
        self.bodies.extend(done.bodies);
        self.machine.handle(now(), done.input);
        done.error.map_or(Ok(()), Err)
    }

    /// Run `effect`. A panic in it (a handler's) ends the session, and the machine is told
    /// `if_panicked` (its deliveries leave unacked).
    fn spawn(&mut self, if_panicked: Input, effect: impl Future<Output = Done> + Send + 'static) {
        self.effects.spawn(async move {
            match std::panic::AssertUnwindSafe(effect).catch_unwind().await {
                Ok(done) => done,
                Err(panic) => {
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(ToString::to_string)
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    let error = Some(format!("handler task failed: panicked with message {why:?}"));
                    Done { input: if_panicked, bodies: Vec::new(), error }
                }
            }
        });
    }
}

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
        let machine = Machine::new(self.rules.clone(), self.settings.batch, now());
        let mut driver = Driver { machine, bodies: HashMap::new(), held: HashMap::new(), effects: JoinSet::new() };
        let watching = broker::watch_blocked(&opened.publishing, self.publishing_flag(), &self.health.readiness);
        let settings = &self.settings;
        let (readiness, flag) = (Arc::clone(&self.health.readiness), self.flag.clone());
        let probing =
            probe::spawn(Arc::clone(&opened.publishing), &settings.endpoint, settings.confirm_timeout, readiness, flag);
        let end = self.consume(connection, &mut opened, &io, &mut driver).await;
        end_session.trigger();
        probing.abort();
        self.wind_down(opened, driver, &io).await;
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
        topology::declare_endpoint(connection, &self.settings.endpoint, &self.settings.policy).await?;
        let (publishing, _) = broker::connect_any(&self.settings.amqp_url, node, &self.publishing_flag()).await?;
        let publisher = Publisher::open(&publishing).await?.with_confirm_timeout(self.settings.confirm_timeout);
        let consumers = self.start_consumers(connection).await?;
        Ok(Opened { consumers, publisher, publishing: Arc::new(publishing) })
    }

    /// Open a channel for the work queue and one for the intake, and consume from each.
    async fn start_consumers(&self, connection: &Connection) -> lapin::Result<Consumers> {
        let endpoint = &self.settings.endpoint;
        let channel = connection.create_channel().await?;
        channel.basic_qos(self.settings.prefetch, BasicQosOptions::default()).await?;
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
        Ok(Consumers { work: Acks::new(channel), deliveries, intake: Acks::new(intake), dead_letters, tag })
    }

    /// Close the consumers' channels and open them again, while nothing is in flight on them: a
    /// delivery the broker counts as handed to this consumer but that never reached it goes back
    /// to the queue only when its channel closes. A quorum queue can leave one so at a leader
    /// change (rabbitmq-server#15473): the new leader resends no delivery, and the broker's queue
    /// client in the channel asks for a missing one only when a later delivery shows the gap,
    /// which an idle consumer never gets. A delivery that arrives meanwhile goes back too, and
    /// comes again, redelivered.
    ///
    /// The whole renewal is bounded by [`WIND_DOWN`]; past it, or on an error, the session ends.
    async fn renew(&self, connection: &Connection, consumers: &mut Consumers) -> Result<(), String> {
        let renewing = async {
            cancel(consumers).await;
            close(consumers, "renewed").await;
            self.start_consumers(connection).await
        };
        let renewed = tokio::time::timeout(WIND_DOWN, renewing).await;
        *consumers = renewed.map_err(|_| "the broker did not answer in time".to_owned())?.map_err(|e| e.to_string())?;
        tracing::debug!("consumers idle: their channels opened again");
        Ok(())
    }

    /// Take deliveries, feed the machine what happens and do what it asks, until shutdown or a
    /// lost connection.
    async fn consume(
        self: &Arc<Self>,
        connection: &Connection,
        opened: &mut Opened,
        io: &Io,
        driver: &mut Driver,
    ) -> SessionEnd {
        // Since when nothing has been in flight: idle for `idle_renewal`, the consumers' channels
        // are opened again (`renew`).
        let mut idle_since = None;
        loop {
            self.perform_all(driver, io);
            debug_assert!(driver.effects.is_empty() || driver.machine.in_flight() > 0);
            let wake_at = driver.machine.poll_timeout().map(Instant::from_std);
            // A held settlement is only ever added by an effect, whose end wakes this loop.
            let holding = !lock(&io.held).is_empty();
            let idle = !holding && driver.effects.is_empty() && driver.machine.is_idle();
            idle_since = idle.then(|| idle_since.unwrap_or_else(Instant::now));
            let renew_at = idle_since.zip(self.settings.idle_renewal).map(|(since, period)| since + period);
            tokio::select! {
                () = self.shutdown.triggered() => return SessionEnd::Shutdown,
                Some(joined) = driver.effects.join_next(), if !driver.effects.is_empty() => {
                    if let Err(error) = driver.finished(joined) {
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
                () = tokio::time::sleep_until(wake_at.unwrap_or_else(Instant::now)), if wake_at.is_some() => {
                    driver.machine.handle_timeout(now());
                }
                () = tokio::time::sleep_until(renew_at.unwrap_or_else(Instant::now)), if renew_at.is_some() => {
                    if let Err(end) = self.renew_idle(connection, &mut opened.consumers, driver).await {
                        return end;
                    }
                    idle_since = None;
                }
                next = opened.consumers.deliveries.next(), if driver.machine.accepting() => {
                    if let Err(end) = self.take(driver, &mut opened.consumers, next).await {
                        return end;
                    }
                }
                next = opened.consumers.dead_letters.next() => match next {
                    Some(Ok(delivery)) => {
                        let delivery = opened.consumers.intake.received(delivery).await;
                        driver.machine.handle(now(), Input::DeadLettered);
                        let parking = Arc::clone(self).park_dead_letter(delivery, io.clone());
                        driver.spawn(Input::DeadLetterParked, parking);
                    }
                    Some(Err(error)) => return lost("broker connection lost", Some(error)),
                    None => return lost("dead-letter consumer cancelled by the broker", None),
                },
            }
        }
    }

    /// The consumers have idled for `idle_renewal`: [`renew`](Self::renew) their channels, unless
    /// a delivery came with the deadline, which is taken instead, not handed back. Shutdown does
    /// not wait for a renewal.
    async fn renew_idle(
        &self,
        connection: &Connection,
        consumers: &mut Consumers,
        driver: &mut Driver,
    ) -> Result<(), SessionEnd> {
        if let Some(next) = consumers.deliveries.next().now_or_never() {
            return self.take(driver, consumers, next).await;
        }
        debug_assert!(driver.bodies.is_empty(), "renewing channels with deliveries on them");
        tokio::select! {
            renewed = self.renew(connection, consumers) => renewed.map_err(|error| {
                tracing::warn!(%error, "cannot consume again on renewed channels; reconnecting");
                SessionEnd::Lost { was_up: true }
            }),
            () = self.shutdown.triggered() => Err(SessionEnd::Shutdown),
        }
    }

    /// What the work queue's consumer gave: a delivery, taken with whatever else is ready to join
    /// a gathering batch, up to a full one; or its end, which ends the session. (lapin tells a
    /// consumer's end once, so it is taken from the batch's gathering too.)
    async fn take(
        &self,
        driver: &mut Driver,
        consumers: &mut Consumers,
        mut next: Option<lapin::Result<Delivery>>,
    ) -> Result<(), SessionEnd> {
        loop {
            match next {
                Some(Ok(delivery)) => self.receive(driver, &consumers.work, delivery).await,
                Some(Err(error)) => return Err(lost("broker connection lost", Some(error))),
                None => return Err(lost("consumer cancelled by the broker", None)),
            }
            if !driver.machine.wants_more() {
                return Ok(());
            }
            match consumers.deliveries.next().now_or_never() {
                Some(ready) => next = ready,
                None => return Ok(()),
            }
        }
    }

    /// A work-queue delivery arrived: record it with its channel, decode it, and tell the machine.
    async fn receive(&self, driver: &mut Driver, work: &Arc<Acks>, delivery: Delivery) {
        let delivery = work.received(delivery).await;
        let tag = Tag(delivery.delivery().delivery_tag);
        let (body, arrival) = self.arrived(delivery);
        let unreadable = body.decoded.as_ref().err().map(ToString::to_string);
        driver.bodies.insert(tag, body);
        driver.machine.handle(now(), Input::Delivered { tag, arrival, unreadable });
    }

    /// Do what the machine asks, until it asks nothing more.
    fn perform_all(self: &Arc<Self>, driver: &mut Driver, io: &Io) {
        while let Some(action) = driver.machine.poll_action(now()) {
            self.perform(action, driver, io);
        }
    }

    /// Do `action`: start its effect, or count and log a wait.
    fn perform(self: &Arc<Self>, action: Action, driver: &mut Driver, io: &Io) {
        match action {
            Action::CountStart(tag) => self.effect_for(driver, tag, |runtime, body| runtime.count_start(tag, body)),
            Action::Apply(tag) => self.effect_for(driver, tag, |runtime, body| runtime.apply_one(tag, body)),
            Action::ApplyBatch(tags) => {
                let endpoint = self.settings.endpoint.name;
                let members: Vec<(Tag, Body)> = tags
                    .iter()
                    .filter_map(|tag| driver.bodies.remove(tag).map(|body| (*tag, body)))
                    .map(|(tag, mut body)| {
                        body.span(endpoint);
                        (tag, body)
                    })
                    .collect();
                driver.spawn(Input::Panicked(tags), Arc::clone(self).apply_together(members));
            }
            Action::Wait { tag, delay, error } => {
                let metrics = &self.metrics;
                driver.held.entry(tag).or_insert_with(|| metrics.held());
                if let Some(body) = driver.bodies.get(&tag) {
                    body.made_span().in_scope(|| {
                        tracing::warn!(
                            %error,
                            ?delay,
                            "the database cannot work now (unreachable, refusing writes, out of resources); \
                             will try again"
                        );
                    });
                }
            }
            Action::Settle { tag, settlement, ledger } => {
                // Held no longer: settling is not waiting for the database.
                driver.held.remove(&tag);
                let io = io.clone();
                self.effect_for(driver, tag, |runtime, body| runtime.settle_one(tag, body, settlement, ledger, io));
            }
        }
    }

    /// Run `effect` on the body of `tag`, in its delivery's span and trace context.
    fn effect_for<E>(self: &Arc<Self>, driver: &mut Driver, tag: Tag, effect: impl FnOnce(Arc<Self>, Body) -> E)
    where
        E: Future<Output = Done> + Send + 'static,
    {
        let Some(mut body) = taken(driver, tag) else { return };
        let (context, span) = (body.context, body.span(self.settings.endpoint.name));
        let effect = effect(Arc::clone(self), body);
        driver.spawn(Input::Panicked(vec![tag]), trace::scope(context, effect.instrument(span)));
    }

    /// Stop new deliveries, then let every in-flight one finish and settle (commit, then ack)
    /// before the channels close; whatever was prefetched but not started, or was waiting for the
    /// database, goes back to the queue when the channel closes. This is the only requeue the
    /// runtime ever causes.
    ///
    /// Every broker call here is bounded: on a connection that has just died, lapin can queue a
    /// request that is never answered. What is still in flight after the handler timeout (plus
    /// time to settle) is abandoned: unacked, it comes back, and the inbox skips what committed.
    async fn wind_down(self: &Arc<Self>, opened: Opened, mut driver: Driver, io: &Io) {
        let Opened { consumers, publisher, publishing } = opened;
        // What waits for the database is handed back at once; what runs finishes and settles.
        driver.machine.handle(now(), Input::SessionEnded);
        self.perform_all(&mut driver, io);
        cancel(&consumers).await;
        // Then the held settlements.
        let drained = tokio::time::timeout(self.settings.handler_timeout + WIND_DOWN, async {
            loop {
                self.perform_all(&mut driver, io);
                if driver.machine.is_drained() && driver.effects.is_empty() {
                    break;
                }
                let wake_at = driver.machine.poll_timeout().map(Instant::from_std);
                tokio::select! {
                    Some(joined) = driver.effects.join_next(), if !driver.effects.is_empty() => {
                        if let Err(error) = driver.finished(joined) {
                            tracing::warn!(%error, "delivery left unacked; the broker will redeliver it");
                        }
                    }
                    () = tokio::time::sleep_until(wake_at.unwrap_or_else(Instant::now)), if wake_at.is_some() => {
                        driver.machine.handle_timeout(now());
                    }
                    else => {
                        // Nothing runs and nothing is due, yet the machine waits: a bug. What it
                        // holds goes back to the broker when the channel closes.
                        debug_assert!(false, "the machine waits for nothing: {:?}", driver.machine);
                        tracing::error!(slots = driver.machine.in_flight(), "the consumer waits for nothing; winding down");
                        break;
                    }
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
                abandoned = driver.effects.len() + held,
                "deliveries still in flight abandoned; the broker will redeliver them"
            );
            driver.effects.abort_all();
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
        close(&consumers, "bye").await;
    }
}

/// Close both consumers' channels (each call bounded).
async fn close(consumers: &Consumers, reason: &str) {
    bounded(consumers.work.channel.close(200, reason.into())).await;
    bounded(consumers.intake.channel.close(200, reason.into())).await;
}

/// Cancel both consumers (each call bounded): the broker sends them nothing more.
async fn cancel(consumers: &Consumers) {
    let Consumers { work, intake, tag, .. } = consumers;
    for (channel, tag) in [(&work.channel, tag.clone()), (&intake.channel, dead_letter_tag(tag))] {
        bounded(channel.basic_cancel(tag.as_str().into(), BasicCancelOptions::default())).await;
    }
}

/// The body of `tag`, taken to run an effect. A body missing would be a bug: the machine is told
/// the delivery is lost, as after a panic (without ending the session), and the broker redelivers
/// it when the channel closes, if it has it.
fn taken(driver: &mut Driver, tag: Tag) -> Option<Body> {
    let body = driver.bodies.remove(&tag);
    if body.is_none() {
        debug_assert!(false, "no body for {tag:?}");
        tracing::error!(?tag, "a delivery the consumer tracks has no body; left unacked");
        driver.machine.handle(now(), Input::Panicked(vec![tag]));
    }
    body
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
