//! The relay: publishes outbox rows to the broker and marks exactly the confirmed ones published.
//!
//! Per outbox database, one loop: claim a batch of due rows in id order (`FOR UPDATE SKIP LOCKED`,
//! so several relays can share a database), publish them all with `mandatory` and publisher
//! confirms pipelined, then in the same transaction mark the confirmed rows and record the
//! returned or nacked ones with a backoff. While one batch is being confirmed and marked, the
//! next is claimed and sent, so the broker always has work. It wakes on `NOTIFY outbox` and
//! polls as a fallback.
//!
//! Crash anywhere and the worst case is a row published twice (confirmed, not yet marked): the
//! message id is stable, so consumers' inboxes absorb it. A row is never marked without a confirm.
//!
//! A row the broker will never take (a body over its `max_message_size`, an exchange the relay's
//! user may not write) does not refuse itself politely: the broker closes the channel, and every
//! publish in flight on it fails with it. The relay then publishes the due rows one at a time on
//! a fresh channel until the broker refuses one (`Relay::isolate`): that row's attempt is
//! counted with the broker's reason and it waits out a backoff, while the rows behind it flow.
//! After `RELAY_MAX_ATTEMPTS` it is parked (the claim skips it), its job is told
//! (`job.quarantined`), and `msgctl outbox` lists and re-arms it.
//!
//! A row whose message would reach fewer queues than the expected topology binds to it
//! (`RELAY_TOPOLOGY`, the shop's by default) is held, not published, until they exist ([`reach`],
//! decision 0030).

pub mod reach;

use std::{str::FromStr, sync::Arc, time::Duration};

use futures_util::FutureExt;
use messaging::{
    contracts::{Contract, JobQuarantined},
    envelope, outage, outbox, outbox_relay,
    publisher::{PublishError, Publisher},
    retention,
    runtime::{
        backoff::Backoff,
        broker::{self, Link, Session, SessionEnd},
        config::{SecretUrl, parse_wait},
        db,
        duration::parse_duration,
        failpoint,
        health::Health,
        metrics::OutboxMetrics,
        shutdown::Shutdown,
    },
    service::{BinarySettings, BoxError, Service, ServiceArgs, StartupError},
    topology,
};
use sqlx::{
    PgPool,
    postgres::{PgConnectOptions, PgListener},
};
use tokio::{sync::Notify, task::JoinSet};
use tracing::Instrument;

use crate::reach::Reach;

/// `relay`: publishes every service's outbox.
#[derive(Debug, Clone, clap::Parser)]
#[command(version, about)]
pub struct Config {
    /// Outbox databases, comma-separated: one relay loop each. Their services create and migrate
    /// them; the relay waits until they exist.
    #[arg(
        long = "database-url",
        env = "DATABASE_URL",
        hide_env_values = true,
        value_delimiter = ',',
        default_value = "postgres://postgres@localhost:5432/orders,postgres://postgres@localhost:5432/inventory,postgres://postgres@localhost:5432/billing"
    )]
    pub database_urls: Vec<SecretUrl>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub db_timeouts: db::DbTimeouts,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub service: ServiceArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub relay: RelaySettings,
}

impl BinarySettings for Config {
    fn service(&self) -> &ServiceArgs {
        &self.service
    }
}

/// How many due rows [`Relay::isolate`] sends one at a time, each awaiting its confirm, to find
/// the one the broker refuses: a round trip each, in one transaction.
const ISOLATE_ROWS: i64 = 64;

/// What the relay's role needs on every outbox: claim and read rows, mark them, delete the old.
pub const OUTBOX_GRANTS: [&str; 3] = ["SELECT", "UPDATE", "DELETE"];

/// The topology whose queues every message must reach before the relay publishes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExpectedTopology {
    /// The shop's ([`shop::topology::shop`]): e.g. a cancelled order's `order.ended` waits until
    /// inventory's and billing's queues both exist.
    Shop,
    /// None: a message that reaches any queue is published (the broker returns one that reaches
    /// none), as before decision 0030. For a broker shared with other systems' exchanges, and for
    /// tests that stand in for some consumers.
    None,
}

impl ExpectedTopology {
    /// Its endpoints and exchanges.
    pub fn topology(self) -> topology::Topology {
        match self {
            Self::Shop => shop::topology::shop(),
            Self::None => topology::Topology::default(),
        }
    }
}

/// How a relay loop claims, waits and retries.
#[derive(Debug, Clone, clap::Args)]
pub struct RelaySettings {
    /// Rows claimed and published per round trip. Two batches are in flight at once (one
    /// being confirmed and marked, the next being sent), so at most twice this many publishes
    /// await a confirm. The default is the fastest of 256 to 2048 in `just bench` here.
    #[arg(long, env = "RELAY_BATCH_SIZE", default_value_t = 2048, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch_size: i64,
    /// After a NOTIFY wakes an idle relay, how long it waits before claiming, so that the rows
    /// committed right behind the first one go out in the same batch (one claim, one mark and one
    /// commit for several orders, instead of one each). Adds up to this much to the commit →
    /// publish latency of a row that wakes it. `0`: claim at once.
    #[arg(long, env = "RELAY_LINGER", default_value = "2ms", value_parser = parse_wait)]
    pub linger: Duration,
    /// Fallback poll when no NOTIFY arrives (e.g. lost while reconnecting).
    #[arg(long, env = "RELAY_POLL_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub poll_interval: Duration,
    /// First wait before republishing a returned or nacked row; doubles per attempt.
    #[arg(long, env = "RELAY_RETRY_INITIAL", default_value = "1s", value_parser = parse_duration)]
    pub retry_initial: Duration,
    /// Longest wait before republishing a returned or nacked row.
    #[arg(long, env = "RELAY_RETRY_MAX", default_value = "1m", value_parser = parse_duration)]
    pub retry_max: Duration,
    /// Attempts at a row whose publish closes the channel (the broker refuses the row itself: too
    /// large, an exchange the relay may not write) before it is parked, its job quarantined. A
    /// returned (unroutable) or nacked row is retried for as long as it takes, as before: those
    /// are the broker's or the topology's state, not the row's.
    #[arg(long, env = "RELAY_MAX_ATTEMPTS", default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_attempts: u32,
    /// Published rows older than this are deleted, and ordering keys that have numbered nothing
    /// for this long.
    #[arg(long, env = "OUTBOX_RETENTION", default_value = "168h", value_parser = parse_duration)]
    pub retention: Duration,
    /// The topology every message must reach in full before it is published: a row whose
    /// exchange, or one of whose bound queues, is missing is held, with the reason on the row.
    #[arg(long = "topology", env = "RELAY_TOPOLOGY", value_enum, default_value = "shop")]
    pub topology: ExpectedTopology,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            batch_size: 2048,
            linger: Duration::from_millis(2),
            poll_interval: Duration::from_secs(1),
            retry_initial: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            max_attempts: 10,
            retention: Duration::from_secs(7 * 24 * 3600),
            topology: ExpectedTopology::Shop,
        }
    }
}

/// One outbox database.
#[derive(Debug, Clone)]
struct OutboxDb {
    /// Its name, as labelled in metrics and logs.
    label: String,
    pool: PgPool,
    /// The pool of the session's `LISTEN` connection alone ([`Wakeups`]).
    listening: PgPool,
    /// Its URL, for start-up errors.
    url: SecretUrl,
}

/// What the relay's sessions with an outbox database start with: the server-side bounds every
/// service's connections get, and the claim planned as a walk of its index
/// ([`outbox_relay::claiming`], decision 0028).
pub fn session_options(options: PgConnectOptions, timeouts: &db::DbTimeouts) -> PgConnectOptions {
    outbox_relay::claiming(db::bounded(options, timeouts))
}

/// Run a relay loop per database until `shutdown`, with health endpoints on `listener`.
pub async fn run(config: Config, listener: tokio::net::TcpListener, shutdown: Shutdown) -> Result<(), BoxError> {
    let broker_args = &config.service.broker;
    let mut service = Service::start(&config.service, shutdown.clone()).await?;
    let mut databases = Vec::new();
    for url in &config.database_urls {
        let options = PgConnectOptions::from_str(url.expose())
            .map_err(|error| StartupError(format!("the database at {url}: {error}")))?;
        let label = options.get_database().unwrap_or("postgres").to_owned();
        // Lazy: the database may not exist yet; the loop retries until it does.
        let options = session_options(options, &config.db_timeouts);
        let pool = db::pool_options(4, Duration::from_secs(5), false).connect_lazy_with(options.clone());
        let listening = db::pool_options(2, Duration::from_secs(5), false).connect_lazy_with(options);
        let outbox = OutboxDb { label, pool, listening, url: url.clone() };
        outbox.check().await?;
        service = service.watch(&outbox.label, outbox.pool.clone());
        databases.push(outbox);
    }
    let health = service.health().clone();
    let expected = Arc::new(config.relay.topology.topology());
    for db in databases {
        let metrics = health.metrics.outbox(&db.label);
        let relay = Relay {
            kept: db::Kept::new(db.pool.clone()),
            db,
            metrics,
            settings: config.relay.clone(),
            expected: Arc::clone(&expected),
            confirm_timeout: broker_args.confirm_timeout,
            health: health.clone(),
            shutdown: shutdown.clone(),
        };
        let link = Link {
            nodes: broker_args.amqp_url.clone(),
            name: relay.flag(),
            backoff: Backoff::default(),
            readiness: health.readiness.clone(),
        };
        let span = tracing::info_span!("relay", database = %relay.db.label);
        // Not ready until this loop is up, from the first probe on.
        service = service.task(&relay.flag(), relay.run(link).instrument(span));
    }
    service.run(listener).await?;
    Ok(())
}

impl OutboxDb {
    /// At start-up: a certificate that does not verify, or credentials the server refuses, is a
    /// [`StartupError`]. A database that is not there yet (or not reachable), its outbox, and the
    /// relay's grants on it are waited for by its loop ([`Relay::wait_for_outbox`]): the service
    /// creates the outbox with its first migration and grants the relay its rights only after
    /// the last, and the relay may start in between.
    async fn check(&self) -> Result<(), StartupError> {
        let refused = |reason: String| StartupError(format!("the database at {}: {reason}", self.url));
        if let Some(reason) = messaging::runtime::tls::unreadable_postgres_file(self.url.expose()) {
            return Err(refused(reason));
        }
        match db::within(db::QUERY_DEADLINE, self.outbox_exists()).await {
            Ok(_) => Ok(()),
            Err(error) => match messaging::outage::verification_failure(&error) {
                Some(reason) => Err(refused(format!("TLS: {reason}"))),
                None if outage::is_unreachable(&error) => Ok(()),
                None => Err(refused(db::describe(&error))),
            },
        }
    }

    /// Whether its database and its outbox table exist yet.
    async fn outbox_exists(&self) -> sqlx::Result<bool> {
        match sqlx::query_scalar("select to_regclass('outbox') is not null").fetch_one(&self.pool).await {
            // 3D000: the database does not exist (yet).
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => Ok(false),
            other => other,
        }
    }
}

/// Why a relay session ended.
#[derive(Debug, thiserror::Error)]
enum SessionError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Broker(#[from] PublishError),
}

impl From<lapin::Error> for SessionError {
    fn from(error: lapin::Error) -> Self {
        Self::Broker(PublishError::Connection(error))
    }
}

/// The loop for one outbox database.
struct Relay {
    db: OutboxDb,
    /// The connection its claims run on, kept between them ([`Claim`]).
    kept: db::Kept,
    /// Its outbox's series.
    metrics: OutboxMetrics,
    settings: RelaySettings,
    /// The topology each row's message must reach in full ([`reach`]).
    expected: Arc<topology::Topology>,
    /// How long a publish waits for its confirm (`CONFIRM_TIMEOUT`).
    confirm_timeout: Duration,
    health: Health,
    shutdown: Shutdown,
}

impl Session for Relay {
    async fn run(&mut self, connection: &lapin::Connection, _node: usize) -> SessionEnd {
        let mut was_up = false;
        let mut reach = Reach::new(connection, &self.expected, &self.metrics, self.confirm_timeout);
        loop {
            let error = match self.session(connection, &mut reach, &mut was_up).await {
                Ok(()) => return SessionEnd::Shutdown,
                Err(error) => error,
            };
            // The broker closed the channel and kept the connection: it refused something sent
            // on it. Find the row, set it aside, and go on on this connection.
            if error.closed_the_channel() && connection.status().connected() && !self.shutdown.is_triggered() {
                tracing::warn!(%error, "the broker closed the relay's channel; sending the due rows one at a time");
                reach.forget();
                match self.isolate(connection, &mut reach).await {
                    Ok(()) => continue,
                    Err(error) => tracing::warn!(%error, "relay session ended while finding a refused row; restarting"),
                }
                return SessionEnd::Lost { was_up };
            }
            // A confirm overdue on a connection the broker does not block: a queue without its
            // majority takes the publish and confirms nothing until the majority is back. Not
            // ready until a confirm comes, whatever the reconnects in between (a blocked
            // connection is reported as blocked instead).
            if matches!(error, SessionError::Broker(PublishError::TimedOut(_))) && !connection.status().blocked() {
                self.health.readiness.set_overdue(&self.flag(), true);
            }
            // Classified, if the database's: a node that refused a write retires the pool's
            // connections, so that the next session reconnects (`outage::is_unreachable`).
            let unavailable = matches!(&error, SessionError::Database(e) if outage::is_unreachable(e));
            tracing::warn!(%error, database_unavailable = unavailable, "relay session ended; restarting");
            return SessionEnd::Lost { was_up };
        }
    }
}

impl SessionError {
    /// Whether the broker ended the channel (a refusal, or the connection going), as opposed to a
    /// database failure or an overdue confirm (the broker is blocked or lost its majority: sending
    /// rows one by one would wait out the deadline once per row).
    fn closed_the_channel(&self) -> bool {
        matches!(self, Self::Broker(PublishError::Connection(_)))
    }
}

impl Relay {
    /// Its database's metric labels.
    /// Its link's name and readiness flag.
    fn flag(&self) -> String {
        format!("relay:{}", self.db.label)
    }

    async fn run(mut self, link: Link) {
        let shutdown = self.shutdown.clone();
        link.readiness.set(&link.name, false);
        if !self.wait_for_outbox(&shutdown).await {
            return;
        }
        let retention = delete_published(self.db.clone(), self.settings.retention, shutdown.clone());
        let retention = tokio::spawn(retention.instrument(tracing::Span::current()));
        broker::run_sessions(&link, &shutdown, &mut self).await;
        let _ = retention.await;
        tracing::info!("relay stopped");
    }

    /// Wait until its service has created and migrated the database, and the relay's role holds
    /// its grants on the outbox: the service that owns the database creates and migrates it, and
    /// may start after the relay. A missing grant is logged by name, once, and checked again, so
    /// that the service's grant, or a DBA's, takes effect without a restart; meanwhile `/readyz`
    /// lists this loop as failing. `false` if shutdown came first.
    async fn wait_for_outbox(&self, shutdown: &Shutdown) -> bool {
        let mut waiting = false;
        let mut refused = None;
        let outbox = ["outbox".to_owned()];
        let grants = || db::check_table_grants(&self.db.pool, &outbox, &OUTBOX_GRANTS);
        loop {
            match db::within(db::QUERY_DEADLINE, self.db.outbox_exists()).await {
                Ok(true) => match db::within(db::QUERY_DEADLINE, grants()).await {
                    Ok(()) => {
                        if waiting {
                            tracing::info!("outbox found");
                        }
                        return true;
                    }
                    // Its service grants them once migrated. If it never does (no
                    // OUTBOX_RELAY_ROLE), this line names what a DBA must grant.
                    Err(error @ sqlx::Error::Configuration(_)) => {
                        let reason = error.to_string();
                        if refused.as_ref() != Some(&reason) {
                            tracing::warn!(%reason, "waiting for the relay's grants on this outbox");
                            refused = Some(reason);
                        }
                    }
                    Err(error) if !waiting => tracing::warn!(%error, "cannot check the relay's grants; waiting"),
                    Err(_) => {}
                },
                Ok(false) if !waiting => {
                    tracing::info!("waiting for its service to create and migrate the database");
                }
                Err(error) if !waiting => tracing::warn!(%error, "cannot reach the database; waiting"),
                _ => {}
            }
            waiting = true;
            if !shutdown.sleep(Duration::from_millis(500)).await {
                return false;
            }
        }
    }

    /// Publish until shutdown (`Ok`) or until the broker or database fails (`Err`); `was_up` is
    /// set once publishing has started.
    async fn session(
        &self,
        connection: &lapin::Connection,
        reach: &mut Reach<'_>,
        was_up: &mut bool,
    ) -> Result<(), SessionError> {
        let (flag, shutdown) = (self.flag(), &self.shutdown);
        let publisher = self.publisher(connection).await?;
        // LISTEN before the first claim: a row committed in between still wakes us.
        let mut wakeups = Wakeups::listen(&self.db.listening).await?;
        self.health.readiness.set(&flag, true);
        *was_up = true;
        tracing::info!("relay publishing");
        // Two batches overlap: while one batch's confirms come back and its rows are marked, the
        // next batch is claimed and put on the wire. The next claim skips the rows the previous
        // batch still holds locked, and goes out after them on the same channel: id order holds.
        // The first error of either half ends the session at once; a batch not yet settled is
        // rolled back, and its rows are published again by the next session.
        //
        // The first claim goes at once: rows an earlier session left, or committed before LISTEN.
        let mut next = self.send_batch(&publisher, reach).await?;
        loop {
            let batch = match next {
                // Flush: what is on the wire is confirmed and marked before we stop.
                Some(batch) if shutdown.is_triggered() => {
                    self.settle(batch).await?;
                    break;
                }
                None if shutdown.is_triggered() => break,
                batch => batch,
            };
            next = match batch {
                // A full batch may have left due rows behind: the next is claimed at once.
                Some(batch) if batch.is_full(self.settings.batch_size) => {
                    tokio::try_join!(self.settle(batch), self.send_batch(&publisher, reach))?.1
                }
                // A batch that took every due row: a claim now would find nothing, and cost a
                // transaction per batch when orders arrive paced. The next claim waits for a NOTIFY.
                Some(batch) => {
                    let wait = self.send_when_due(&mut wakeups, &publisher, reach);
                    tokio::try_join!(self.settle(batch), wait)?.1
                }
                None => self.send_when_due(&mut wakeups, &publisher, reach).await?,
            };
        }
        publisher.close().await;
        Ok(())
    }

    /// Wait until rows may be due (a NOTIFY, or the fallback poll), linger, then claim and send
    /// them as [`Self::send_batch`] does. `None` on shutdown, or if nothing was due.
    async fn send_when_due(
        &self,
        wakeups: &mut Wakeups,
        publisher: &Publisher,
        reach: &mut Reach<'_>,
    ) -> Result<Option<SentBatch>, SessionError> {
        tokio::select! {
            () = self.shutdown.triggered() => return Ok(None),
            woken = wakeups.next() => {
                woken?;
                if !self.settings.linger.is_zero() && !self.shutdown.sleep(self.settings.linger).await {
                    return Ok(None);
                }
            }
            () = tokio::time::sleep(self.settings.poll_interval) => {}
        }
        // Each NOTIFY received so far announced a row committed before this claim begins, which
        // the claim therefore sees: none of them needs another claim.
        wakeups.take();
        self.send_batch(publisher, reach).await
    }

    /// Claim a batch of due rows and publish them all without waiting for confirms, but hold the
    /// rows whose message would not reach every queue the topology binds to it ([`reach`]). `None`
    /// if nothing is due. The batch's transaction keeps its rows locked until [`Relay::settle`].
    async fn send_batch(
        &self,
        publisher: &Publisher,
        reach: &mut Reach<'_>,
    ) -> Result<Option<SentBatch>, SessionError> {
        let (mut tx, claimed) = self.claim(self.settings.batch_size).await?;
        let mut rows = Vec::with_capacity(claimed.len());
        for row in claimed {
            match reach.hold_reason(&row).await? {
                Some(reason) => self.hold(&mut tx, &row, &reason).await?,
                None => rows.push(row),
            }
        }
        reach.report(self.settings.retry_max);
        if rows.is_empty() {
            db::within(db::QUERY_DEADLINE, tx.commit(&self.kept)).await?;
            return Ok(None);
        }
        let mut sent = Vec::with_capacity(rows.len());
        let mut spans = Vec::with_capacity(rows.len());
        for row in &rows {
            spans.push(row.publish_span());
            sent.push(publisher.send(&row.exchange, &row.routing_key, row.payload.as_bytes(), row.properties()).await);
        }
        Ok(Some(SentBatch { tx, rows, sent, spans }))
    }

    /// [`Self::settle_batch`] in the batch's span: what is logged while settling it carries its size
    /// and the range of its rows' ids.
    async fn settle(&self, batch: SentBatch) -> Result<(), SessionError> {
        let first_id = batch.rows.first().map(|row| row.id);
        let last_id = batch.rows.last().map(|row| row.id);
        let span = tracing::info_span!("relay_batch", rows = batch.rows.len(), first_id, last_id);
        self.settle_batch(batch).instrument(span).await
    }

    /// Collect a sent batch's confirms in order, mark the confirmed rows, record the returned or
    /// nacked ones with a backoff, and commit.
    async fn settle_batch(&self, batch: SentBatch) -> Result<(), SessionError> {
        // Each row's publish span ends when this does: after the commit that marks it.
        let SentBatch { mut tx, rows, sent, spans } = batch;
        let mut confirmed = Vec::with_capacity(rows.len());
        // When each confirmed row was committed, for the commit -> confirm lag.
        let mut committed_at = Vec::with_capacity(rows.len());
        let mut confirmed_spans = Vec::with_capacity(rows.len());
        let mut settled = 0;
        let mut broken = None;
        let backoff = Backoff::new(self.settings.retry_initial, self.settings.retry_max);
        for ((row, sent), span) in rows.iter().zip(sent).zip(&spans) {
            settled += 1;
            let outcome = match sent {
                Ok(pending) => pending.confirmed().await,
                Err(error) => Err(error),
            };
            published(span, &outcome);
            match outcome {
                Ok(()) => {
                    confirmed.push(row.id);
                    committed_at.push(row.created_at);
                    confirmed_spans.push(span);
                }
                // The channel is gone: the outcome of this and later rows is unknown. They stay
                // unpublished and are republished by the next session.
                Err(error) if error.is_connection() => {
                    broken = Some(error);
                    break;
                }
                Err(error) => self.refused(&mut tx, row, &error.to_string(), &backoff, false).await?,
            }
        }
        // The rows after a lost channel: never confirmed, sent again by the next session.
        for span in spans.iter().skip(settled) {
            span.record("outcome", "unconfirmed: the channel was lost first").record("otel.status_code", "error");
        }
        failpoint::hit(failpoint::RELAY_AFTER_CONFIRM).await;
        // Rows confirmed before a broken channel are still marked: marking is what keeps a
        // reconnect from republishing them.
        db::within(db::QUERY_DEADLINE, async {
            outbox_relay::mark_published(&mut tx, &confirmed).await?;
            tx.commit(&self.kept).await
        })
        .await?;
        marked(&confirmed_spans);
        self.metrics.published(confirmed.len() as u64);
        if !confirmed.is_empty() {
            self.health.readiness.set_overdue(&self.flag(), false);
        }
        let now = chrono::Utc::now();
        for committed in committed_at {
            self.metrics.publish_lag((now - committed).to_std().unwrap_or_default().as_secs_f64());
        }
        match broken {
            Some(error) => Err(error.into()),
            None => Ok(()),
        }
    }
}

impl Relay {
    /// A confirming channel on `connection`, with the relay's confirm deadline.
    async fn publisher(&self, connection: &lapin::Connection) -> lapin::Result<Publisher> {
        Ok(Publisher::open(connection).await?.with_confirm_timeout(self.confirm_timeout))
    }

    /// Begin a transaction and claim up to `limit` due rows in it (locked until it ends).
    async fn claim(&self, limit: i64) -> Result<(Claim, Vec<outbox_relay::OutboxRow>), sqlx::Error> {
        self.metrics.claimed();
        db::within(db::QUERY_DEADLINE, async {
            let mut tx = Claim::begin(&self.kept).await?;
            let rows = outbox_relay::claim_unpublished(&mut tx, limit).await?;
            Ok((tx, rows))
        })
        .await
    }

    /// Record a row the broker refused in `tx`: its attempt, the reason, and when it is due again.
    /// `closed_the_channel`: the row itself was refused (counted toward parking it), rather than
    /// returned or nacked.
    async fn refused(
        &self,
        tx: &mut sqlx::PgConnection,
        row: &outbox_relay::OutboxRow,
        reason: &str,
        backoff: &Backoff,
        closed_the_channel: bool,
    ) -> Result<(), SessionError> {
        let retry_after = backoff.delay(u32::try_from(row.attempts).unwrap_or(0));
        tracing::warn!(id = row.id, message_id = %row.message_id, reason, ?retry_after, "publish refused; will retry");
        let record = async {
            if closed_the_channel {
                outbox_relay::record_refusal(tx, row.id, reason, retry_after).await
            } else {
                outbox_relay::record_failure(tx, row.id, reason, retry_after).await
            }
        };
        db::within(db::QUERY_DEADLINE, record).await?;
        self.metrics.publish_failed();
        Ok(())
    }

    /// Hold a row whose message would not reach every queue it must ([`reach`]): it stays
    /// unpublished with `reason`, and is claimed again after a backoff. Not a refusal: a row held
    /// for as long as the topology is incomplete is never parked.
    async fn hold(
        &self,
        tx: &mut sqlx::PgConnection,
        row: &outbox_relay::OutboxRow,
        reason: &str,
    ) -> Result<(), SessionError> {
        let backoff = Backoff::new(self.settings.retry_initial, self.settings.retry_max);
        let retry_after = backoff.delay(u32::try_from(row.attempts).unwrap_or(0));
        tracing::warn!(id = row.id, message_id = %row.message_id, reason, ?retry_after, "row held");
        db::within(db::QUERY_DEADLINE, outbox_relay::record_failure(tx, row.id, reason, retry_after)).await?;
        Ok(())
    }

    /// After the broker closed the channel with the connection still up: publish the first
    /// [`ISOLATE_ROWS`] due rows one at a time on a fresh channel, each awaiting its confirm, until
    /// the broker refuses one. That row's refusal is counted, with the broker's reason, and it
    /// waits out a backoff (or, at `RELAY_MAX_ATTEMPTS`, is parked); the rows confirmed before it
    /// are marked. The rest go on in batches. The row that closed a batch's channel is almost
    /// always the first due one (the rows confirmed before it were marked); if none of these is
    /// refused (the channel closed for another reason, or the culprit lies further on), they are
    /// published, and a batch that closes the channel again brings the relay back here, past them.
    async fn isolate(&self, connection: &lapin::Connection, reach: &mut Reach<'_>) -> Result<(), SessionError> {
        let (mut tx, rows) = self.claim(ISOLATE_ROWS.min(self.settings.batch_size)).await?;
        let backoff = Backoff::new(self.settings.retry_initial, self.settings.retry_max);
        let mut confirmed = Vec::new();
        // The rows' publish spans, ended with this round: the confirmed ones apart, to be marked.
        let (mut confirmed_spans, mut spans) = (Vec::new(), Vec::new());
        let mut outcome = Ok(());
        let publisher = self.publisher(connection).await?;
        for row in &rows {
            // A lookup that fails ends the round like a lost connection: the rows confirmed
            // before it are still marked.
            match reach.hold_reason(row).await {
                Ok(None) => {}
                Ok(Some(reason)) => {
                    self.hold(&mut tx, row, &reason).await?;
                    continue;
                }
                Err(error) => {
                    outcome = Err(error.into());
                    break;
                }
            }
            let span = row.publish_span();
            let sent =
                publisher.publish(&row.exchange, &row.routing_key, row.payload.as_bytes(), row.properties()).await;
            published(&span, &sent);
            if sent.is_ok() {
                confirmed_spans.push(span);
            } else {
                spans.push(span);
            }
            match sent {
                Ok(()) => confirmed.push(row.id),
                // Returned or nacked: refused politely, the channel lives on.
                Err(error @ (PublishError::Returned(_) | PublishError::Nacked)) => {
                    self.refused(&mut tx, row, &error.to_string(), &backoff, false).await?;
                }
                // This row, sent alone, closed the channel and nothing else: the broker refuses it.
                Err(PublishError::Connection(error)) if connection.status().connected() => {
                    self.refuse_for_good_or_retry(&mut tx, row, &error.to_string(), &backoff, connection).await?;
                    break;
                }
                // The connection went, or the confirm is overdue: not this row's doing.
                Err(error) => {
                    outcome = Err(error.into());
                    break;
                }
            }
        }
        db::within(db::QUERY_DEADLINE, async {
            outbox_relay::mark_published(&mut tx, &confirmed).await?;
            tx.commit(&self.kept).await
        })
        .await?;
        marked(&confirmed_spans);
        self.metrics.published(confirmed.len() as u64);
        publisher.close().await;
        outcome
    }

    /// A row that closed the channel on its own: retried after a backoff, or, at its
    /// `max_attempts`-th refusal, parked and its job told (`job.quarantined`, on a fresh channel,
    /// its `attempt` counting every try of the row: refusals, returns and nacks).
    async fn refuse_for_good_or_retry(
        &self,
        tx: &mut sqlx::PgConnection,
        row: &outbox_relay::OutboxRow,
        reason: &str,
        backoff: &Backoff,
        connection: &lapin::Connection,
    ) -> Result<(), SessionError> {
        let reason = format!("the broker closed the channel: {reason}");
        let attempt = u32::try_from(row.attempts).unwrap_or(0) + 1;
        if u32::try_from(row.refusals).unwrap_or(0) + 1 < self.settings.max_attempts {
            return self.refused(tx, row, &reason, backoff, true).await;
        }
        if let Some(job_id) = row.headers.0.correlation_id {
            let event = JobQuarantined {
                job_id,
                endpoint: format!("outbox:{}", self.db.label),
                message_id: Some(row.message_id),
                message_type: Some(row.message_type.clone()),
                attempt,
                error: reason.clone(),
                redrive_count: 0,
            };
            // Told before the row is parked: if the process dies in between, the row is refused
            // and parked again, and the job told again (the status consumer applies it once).
            let (body, properties) = envelope::job_event(&event).expect("a job event serializes");
            let publisher = self.publisher(connection).await?;
            topology::ensure_exchanges(connection, &[JobQuarantined::EXCHANGE]).await?;
            match publisher.publish(JobQuarantined::EXCHANGE, JobQuarantined::TYPE, &body, properties).await {
                Ok(()) => {}
                // No status consumer bound: nobody tracks jobs here, and the row is parked anyway.
                Err(PublishError::Returned(reply)) => tracing::warn!(%job_id, reply, "job.quarantined went nowhere"),
                Err(error) => return Err(error.into()),
            }
            publisher.close().await;
        }
        tracing::error!(id = row.id, message_id = %row.message_id, attempt, reason, "outbox row parked: the broker refuses it");
        db::within(db::QUERY_DEADLINE, outbox_relay::park(tx, row.id, &reason)).await?;
        self.metrics.publish_failed();
        Ok(())
    }
}

/// A claim's transaction, on the connection the relay keeps between its claims ([`db::Kept`]).
///
/// It outlives the function that begins it (a batch is marked while the next is sent), so it must
/// own its connection; sqlx's `Transaction` that owns one hands it back to the pool when it ends,
/// with the round trip that keeping it saves. So this one sends its own `begin` and `commit`. Ended
/// any other way (an error, a deadline, the session's end), it closes its connection rather than
/// letting it go back to the pool: the server then rolls back what it holds.
struct Claim {
    connection: db::Taken,
}

impl Claim {
    async fn begin(kept: &db::Kept) -> Result<Self, sqlx::Error> {
        let mut connection = kept.take().await?;
        // Until the commit has been answered.
        connection.close_on_drop();
        sqlx::query("begin").execute(&mut *connection).await?;
        Ok(Self { connection })
    }

    /// Commit, and keep the connection for the next claim.
    async fn commit(mut self, kept: &db::Kept) -> Result<(), sqlx::Error> {
        sqlx::query("commit").execute(&mut *self.connection).await?;
        self.connection.return_on_drop();
        kept.keep(self.connection);
        Ok(())
    }
}

impl std::ops::Deref for Claim {
    type Target = sqlx::PgConnection;

    fn deref(&self) -> &sqlx::PgConnection {
        &self.connection
    }
}

impl std::ops::DerefMut for Claim {
    fn deref_mut(&mut self) -> &mut sqlx::PgConnection {
        &mut self.connection
    }
}

/// A batch on the wire: its transaction (holding the rows' locks), its rows, and each row's
/// pending confirm (or the error that kept it from being sent).
struct SentBatch {
    tx: Claim,
    rows: Vec<outbox_relay::OutboxRow>,
    sent: Vec<Result<messaging::publisher::Pending, PublishError>>,
    /// Each row's publish span ([`outbox_relay::OutboxRow::publish_span`]).
    spans: Vec<tracing::Span>,
}

/// Record on the publish spans of confirmed rows that their mark is committed: a span without
/// `marked` is of a row that stays unpublished (the commit failed, or never came), sent again.
fn marked(spans: &[impl std::borrow::Borrow<tracing::Span>]) {
    for span in spans {
        span.borrow().record("marked", true);
    }
}

/// Record on a row's publish span what became of it: confirmed, or the broker's refusal (an
/// error), or the channel lost before its confirm (an error too: it is sent again).
fn published(span: &tracing::Span, outcome: &Result<(), PublishError>) {
    match outcome {
        Ok(()) => span.record("outcome", "confirmed"),
        Err(error) => span.record("outcome", tracing::field::display(error)).record("otel.status_code", "error"),
    };
}

impl SentBatch {
    /// Whether the claim took as many rows as it could: then more may be due behind them.
    fn is_full(&self, batch_size: i64) -> bool {
        self.rows.len() as i64 >= batch_size
    }
}

/// The outbox's NOTIFYs, as wake-ups: however many are received before the relay takes one, they
/// leave one, since the claim that follows sees every row they announced. (Until 2026-12-05 each
/// NOTIFY received cost a claim of its own: after a burst the relay claimed about 290 times a
/// second with nothing due, until it had read them all.)
///
/// A task of its own receives them. The relay gives up a wait for a NOTIFY whenever its fallback
/// poll or shutdown comes first, and `PgListener::try_recv` may be given up while it reads, but
/// not while it reconnects: it hands its notification channel to the new connection before that
/// connection's `LISTEN` has returned, and a connection dropped there goes back to its pool still
/// listening. The task is given up only when the session ends, and its connections come from a
/// pool of their own, so that such a connection is never handed to a claim.
struct Wakeups {
    /// Holds one wake-up at most: `notify_one` with nobody waiting stores a single permit.
    notify: Arc<Notify>,
    /// The receiving task, which ends only with the listener's error; aborted when this drops.
    receiving: JoinSet<sqlx::Error>,
}

impl Wakeups {
    /// `LISTEN` on a connection from `pool` (one that serves nothing else), done when this returns:
    /// a row committed after it wakes the relay. Then receive on a task of its own.
    async fn listen(pool: &PgPool) -> Result<Self, sqlx::Error> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(outbox::NOTIFY_CHANNEL).await?;
        let notify = Arc::new(Notify::new());
        let wake = Arc::clone(&notify);
        let mut receiving = JoinSet::new();
        let receive = async move {
            loop {
                match listener.try_recv().await {
                    // A NOTIFY; or `None`: the connection was lost and another now listens, and a
                    // NOTIFY sent in between was lost with it, so its rows need a claim too.
                    Ok(_) => wake.notify_one(),
                    Err(error) => return error,
                }
            }
        };
        receiving.spawn(receive.instrument(tracing::Span::current()));
        Ok(Self { notify, receiving })
    }

    /// Until a NOTIFY has come since the last wake-up was taken; the listener's error if it
    /// stopped. Cancel-safe: a wake-up not taken stays.
    async fn next(&mut self) -> Result<(), sqlx::Error> {
        tokio::select! {
            () = self.notify.notified() => Ok(()),
            ended = self.receiving.join_next() => Err(match ended {
                Some(Ok(error)) => error,
                // A panic, not an outage (`outage::is_unreachable` takes I/O errors for one).
                Some(Err(stopped)) => sqlx::Error::Protocol(format!("the NOTIFY listener stopped: {stopped}")),
                None => sqlx::Error::Protocol("the NOTIFY listener is gone".to_owned()),
            }),
        }
    }

    /// Take the wake-up left by NOTIFYs received since the last one was taken, if any, without
    /// waiting.
    fn take(&self) {
        let _ = self.notify.notified().now_or_never();
    }
}

/// Delete published rows and idle ordering keys past retention, in small batches, at start-up and
/// hourly.
async fn delete_published(db: OutboxDb, retention: Duration, shutdown: Shutdown) {
    retention::run("published outbox rows and ordering keys", shutdown, || {
        retention::delete_published_before(&db.pool, retention, retention::BATCH)
    })
    .await;
}
