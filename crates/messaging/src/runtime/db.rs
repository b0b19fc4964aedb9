//! Database start-up: create the service's database if it is missing (and the role may), migrate
//! (as the schema's owner if a migration URL is given), connect a pool, check the runtime role's
//! grants. Safe when several instances start together: `CREATE DATABASE` races are tolerated and
//! sqlx's migrator holds an advisory lock while it migrates.
//!
//! Every query is bounded twice (docs/guarantees.md, "stalled database"): the server cancels a
//! statement after its [`DbTimeouts`] (statement, lock wait, idle in transaction), and the client
//! gives up after [`QUERY_DEADLINE`] on work wrapped in [`within`], which also covers a connection
//! that has gone silent (a black hole, where the server's cancel never arrives and the kernel
//! would wait about 15 minutes).

use std::{
    future::Future,
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use sqlx::{
    AssertSqlSafe, Connection, PgConnection, PgPool, Postgres, Transaction,
    migrate::{MigrateError, Migrator},
    pool::PoolConnection,
    postgres::{PgConnectOptions, PgPoolOptions},
};

use messaging_core::outage::{is_unreachable, last_retirement, opened_before};

use crate::runtime::{
    backoff::Backoff, config::SecretUrl, duration::parse_duration, shutdown::Shutdown, startup::StartupError,
};

/// How long the client waits for one unit of database work (a transaction, a batch) wrapped in
/// [`within`] before it gives up and treats the database as unreachable.
pub const QUERY_DEADLINE: Duration = Duration::from_secs(10);

/// The server-side bounds every pooled connection gets (migrations run on a connection of their
/// own, without them). Each turns a wait into an error the caller retries.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct DbTimeouts {
    /// `statement_timeout`: the server cancels a statement running longer (SQLSTATE 57014, retried).
    #[arg(long = "db-statement-timeout", env = "DB_STATEMENT_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub statement: Duration,
    /// `lock_timeout`: a statement waiting longer for a row or table lock fails (55P03, retried)
    /// instead of queueing behind a stuck transaction; shorter than the statement timeout.
    #[arg(long = "db-lock-timeout", env = "DB_LOCK_TIMEOUT", default_value = "3s", value_parser = parse_duration)]
    pub lock: Duration,
    /// `idle_in_transaction_session_timeout`: the server ends a session whose transaction has been
    /// idle this long (a hung or partitioned client), releasing its locks.
    #[arg(long = "db-idle-in-transaction-timeout", env = "DB_IDLE_IN_TRANSACTION_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub idle_in_transaction: Duration,
}

impl Default for DbTimeouts {
    fn default() -> Self {
        Self {
            statement: Duration::from_secs(5),
            lock: Duration::from_secs(3),
            idle_in_transaction: Duration::from_secs(30),
        }
    }
}

/// `work` on the database, abandoned after `limit` with an I/O `TimedOut` error, which
/// [`is_unreachable`] counts as an outage. Dropping the work drops its connection's transaction,
/// which the server rolls back.
pub async fn within<T, E: From<sqlx::Error>>(
    limit: Duration,
    work: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    match tokio::time::timeout(limit, work).await {
        Ok(outcome) => outcome,
        Err(_) => Err(E::from(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer from the database within {}", crate::runtime::duration::format_duration(limit)),
        )))),
    }
}

/// A connection from `pool`, as `pool.acquire()` gives it, for work done once per batch.
///
/// sqlx 0.9's acquire future is about 14 KB (it holds a whole connect, for when the pool must open
/// a connection). Awaited inside a caller's own future, through [`within`]'s timeout, it was
/// copied several times on every call: under callgrind, the API's writer spent 59,000 of its
/// 180,000 instructions per order in `memcpy` (concurrency 1). Boxed, it is built once on the
/// heap and copied once: 152,000 per order, 30,000 of them `memcpy` (130,000 with sqlx 0.8).
pub async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>, sqlx::Error> {
    Box::pin(pool.acquire()).await
}

/// A pooled connection idle at least this long is checked with a round trip before it is handed
/// out; one in use more recently is handed out as it is.
pub const CHECK_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// One connection kept between the transactions of a loop (a consumer's messages, the relay's
/// claims) instead of going back to its pool after each (decision 0029).
/// sqlx sends a round trip (a ping, from a task of its own) with every connection it takes back:
/// at light load, when each transaction holds one message, one of its eight or so.
///
/// Only a connection whose work ended cleanly is kept ([`Kept::keep`]). One dropped after an
/// error goes back to the pool as before, whose ping closes it if it is broken; one given up
/// mid-way (a deadline) is closed ([`Taken::close_on_drop`]). A kept connection is checked after a
/// second idle ([`Kept::take`]), and let go when it is on a node that refuses writes (asked after
/// a `retire_connections`), has been idle for the pool's `idle_timeout`, or out of the pool for its
/// `max_lifetime`; a loop that stays idle holds it until its next take. Tasks that share one take
/// turns with it: a task that finds it taken gets another from the pool, and the spare goes back
/// to the pool when both keep theirs.
#[derive(Debug)]
pub struct Kept {
    pool: PgPool,
    slot: std::sync::Mutex<Option<(Taken, std::time::Instant)>>,
}

/// A connection from [`Kept::take`], to hand back with [`Kept::keep`] once its work ended cleanly.
#[derive(Debug)]
pub struct Taken {
    connection: PoolConnection<Postgres>,
    /// When it left the pool: it was opened before then.
    acquired: std::time::Instant,
    /// The last retirement (`retire_connections`) it was checked against: by its pool when it
    /// was handed out, or by [`Kept::take`] since.
    answered: u64,
    /// Closed when dropped, rather than handed back to the pool.
    closing: bool,
}

impl Kept {
    /// Nothing kept yet; connections come from `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self { pool, slot: std::sync::Mutex::new(None) }
    }

    /// The kept connection, if there is one still fit to use, or else one from the pool.
    ///
    /// Checked with a round trip when it has been idle for [`CHECK_IF_IDLE_FOR`], even on a pool
    /// that checks each connection it hands out (the API's: `PoolSettings::check_each_acquire`,
    /// decision 0018). That pool checks each so that a request finds a stalled database within
    /// its acquire timeout and answers 503; a loop's work has a deadline of its own (a handler's,
    /// a query's), and a check on every take would be one more round trip in each of its
    /// transactions. The check has the pool's acquire timeout: a database that does not answer
    /// within it is an outage (`PoolTimedOut`), as it is when the pool's own check goes
    /// unanswered. Closed instead, as the pool closes its own: one that failed its check, one on
    /// a node that refuses writes (asked, once, after a retirement since it left the pool), one
    /// idle for the pool's `idle_timeout`, or out of it for its `max_lifetime` (counted from when
    /// it left the pool, which sqlx does not say).
    pub async fn take(&self) -> Result<Taken, sqlx::Error> {
        let kept = self.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        if let Some((mut taken, idle_since)) = kept {
            let options = self.pool.options();
            let (out_for, idle_for) = (taken.acquired.elapsed(), idle_since.elapsed());
            // A node refused a write since it left the pool: is it on one (`retire_connections`)?
            let mark = last_retirement();
            let asked = mark > taken.answered && opened_before(mark, out_for);
            if asked {
                taken.answered = mark;
                taken.closing = !writes(&mut taken.connection).await;
            }
            if taken.closing
                || options.get_max_lifetime().is_some_and(|lifetime| out_for >= lifetime)
                || options.get_idle_timeout().is_some_and(|timeout| idle_for >= timeout)
            {
                taken.closing = true;
            } else if asked || idle_for < CHECK_IF_IDLE_FOR {
                return Ok(taken);
            } else {
                // One that fails is closed: back in the pool, sqlx's round trip on its return
                // would wait on a silent connection with no deadline.
                taken.closing = true;
                match tokio::time::timeout(options.get_acquire_timeout(), taken.connection.ping()).await {
                    Ok(Ok(())) => {
                        taken.closing = false;
                        return Ok(taken);
                    }
                    Ok(Err(_)) => {}
                    Err(_) => return Err(sqlx::Error::PoolTimedOut),
                }
            }
        }
        Taken::acquire(&self.pool).await
    }

    /// Keep `taken` for the next [`take`](Self::take): only once its transaction has committed or
    /// rolled back, or its statement has returned. A connection already kept stays, and `taken`
    /// goes back to the pool; one marked to close is closed.
    pub fn keep(&self, taken: Taken) {
        if taken.closing {
            return;
        }
        let mut slot = self.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some((taken, std::time::Instant::now()));
        }
    }
}

impl Taken {
    /// A connection from `pool`, for work done once (not kept): for [`Taken::begin`].
    pub async fn acquire(pool: &PgPool) -> Result<Self, sqlx::Error> {
        // Before the pool's own checks, which answer every retirement up to then: a retirement
        // meanwhile then counts against it.
        let (acquired, answered) = (std::time::Instant::now(), last_retirement());
        Ok(Self { connection: acquire(pool).await?, acquired, answered, closing: false })
    }

    /// Close the connection when this is dropped, instead of handing it back to the pool: for
    /// work that may be given up mid-way, whose unread answers sqlx's round trip on return would
    /// wait for with no deadline, or for a transaction that sqlx does not know of.
    pub fn close_on_drop(&mut self) {
        self.closing = true;
    }

    /// Undo [`Taken::close_on_drop`]: the work on it ended, every answer read.
    pub fn return_on_drop(&mut self) {
        self.closing = false;
    }

    /// Begin a transaction, as `Connection::begin` does, but close the connection if this is given
    /// up before the `BEGIN` is answered (a deadline). sqlx counts the transaction only once
    /// answered, so its rollback on drop sends nothing then, and the connection would go back to
    /// the pool inside the server's transaction: the next statements of its next user would run
    /// there, and be lost if nothing commits them. A `BEGIN` that fails closes the connection too.
    pub async fn begin(&mut self) -> Result<Transaction<'_, Postgres>, sqlx::Error> {
        let closing = std::mem::replace(&mut self.closing, true);
        let transaction = self.connection.begin().await?;
        self.closing = closing;
        Ok(transaction)
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if self.closing {
            self.connection.close_on_drop();
        }
    }
}

impl std::ops::Deref for Taken {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.connection
    }
}

impl std::ops::DerefMut for Taken {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.connection
    }
}

/// The pool options every service opens its pools with. sqlx's default checks every connection
/// with a round trip each time it is handed out, besides the one it always makes when a
/// connection goes back (which a loop that keeps its connection saves, [`Kept`]): two of a paced
/// transaction's round trips, and a round trip cost about 300 µs of the machine's CPU on a 2-core
/// VM (`pgbench`, `select 1`). Unless `check_each_acquire`, only a connection idle for
/// [`CHECK_IF_IDLE_FOR`] is checked. One that broke within that second (the server restarted, a
/// proxy cut it) fails its first statement instead: an error the caller already handles as a lost
/// database (a retry that spends no attempt, a new relay session), after which sqlx's check on
/// return closes it (decision 0018).
///
/// After a node refused a write (`retire_connections`), the pool asks whether its connections are
/// on such a node (see `Retirement`), as one is handed out or comes back.
pub fn pool_options(max_connections: u32, acquire_timeout: Duration, check_each_acquire: bool) -> PgPoolOptions {
    let retirement = Arc::new(Retirement::default());
    let on_release = Arc::clone(&retirement);
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(check_each_acquire)
        .before_acquire(move |connection, meta| {
            let retirement = Arc::clone(&retirement);
            Box::pin(async move {
                // Closed, when it may be on a node that refuses writes; the pool opens another.
                if !retirement.keeps(connection, meta.age).await {
                    return Ok(false);
                }
                if !check_each_acquire && meta.idle_for >= CHECK_IF_IDLE_FOR {
                    connection.ping().await?;
                }
                Ok(true)
            })
        })
        // The connection that met the refusal comes back first: it answers for its pool.
        .after_release(move |connection, meta| {
            let retirement = Arc::clone(&on_release);
            Box::pin(async move { Ok(retirement.keeps(connection, meta.age).await) })
        })
}

/// What one pool knows of the retirements (`retire_connections`: a node refused a write, and
/// every connection opened before may be on it). The error does not say which database refused,
/// so each pool asks one of its own connections opened before the retirement whether its node
/// takes writes ([`takes_writes`]'s question): only a pool whose answer is no closes its
/// connections opened before then. One round trip a pool a retirement; the relay's pools to the
/// databases that take writes keep their connections (issue 56, row 4).
///
/// A pool whose connections were split between two nodes (opened before and after an address
/// moved) may answer from one on the node that writes; the other's next write is refused in turn,
/// and that retirement is answered by it as it comes back.
#[derive(Debug, Default)]
struct Retirement {
    /// The last retirement this pool has answered.
    answered: AtomicU64,
    /// The last retirement that found this pool on a node that refuses writes.
    retired: AtomicU64,
}

impl Retirement {
    /// Whether `connection`, opened `age` ago, may stay in the pool: not if it was opened before
    /// a retirement that found this pool on a node that refuses writes. A retirement not answered
    /// yet is answered here, by this connection if it was opened before it.
    async fn keeps(&self, connection: &mut PgConnection, age: Duration) -> bool {
        let mark = last_retirement();
        if mark > self.answered.load(Ordering::Relaxed) && opened_before(mark, age) {
            let writes = writes(connection).await;
            self.answered.fetch_max(mark, Ordering::Relaxed);
            if !writes {
                self.retired.fetch_max(mark, Ordering::Relaxed);
            }
        }
        !opened_before(self.retired.load(Ordering::Relaxed), age)
    }
}

/// The question of [`takes_writes`]: a primary (not `pg_is_in_recovery`), and not a session left
/// read-only (`transaction_read_only`).
const TAKES_WRITES: &str = "select not pg_is_in_recovery() and current_setting('transaction_read_only') = 'off'";

/// Whether `connection`'s node takes writes ([`TAKES_WRITES`]), answered within two seconds.
async fn writes(connection: &mut PgConnection) -> bool {
    let query = sqlx::query_scalar::<_, bool>(TAKES_WRITES);
    matches!(within(Duration::from_secs(2), query.fetch_one(connection)).await, Ok(true))
}

/// Whether the database answers within two seconds, as a primary that takes writes: not a standby
/// (`pg_is_in_recovery`) and not a session left read-only (`transaction_read_only`). A node that
/// refuses writes is no more use to a service than one that is down ([`is_wrong_node`](messaging_core::outage::is_wrong_node)).
pub async fn takes_writes(pool: &PgPool) -> bool {
    let query = sqlx::query_scalar::<_, bool>(TAKES_WRITES);
    matches!(within(Duration::from_secs(2), query.fetch_one(pool)).await, Ok(true))
}

/// `options` with the server-side [`DbTimeouts`] every pooled connection gets.
pub fn bounded(options: PgConnectOptions, timeouts: &DbTimeouts) -> PgConnectOptions {
    options.options([
        ("statement_timeout", timeouts.statement.as_millis()),
        ("lock_timeout", timeouts.lock.as_millis()),
        ("idle_in_transaction_session_timeout", timeouts.idle_in_transaction.as_millis()),
    ])
}

/// Pool settings.
#[derive(Debug, Clone, Copy)]
pub struct PoolSettings {
    /// Connections at most.
    pub max_connections: u32,
    /// How long a caller waits for a free connection before getting an error (which the API turns
    /// into a 503 and the consumers into a retry) instead of hanging.
    pub acquire_timeout: Duration,
    /// The server-side bounds of every connection.
    pub timeouts: DbTimeouts,
    /// Check every connection with a round trip as it is handed out (sqlx's default), instead of
    /// only one idle for [`CHECK_IF_IDLE_FOR`] ([`pool_options`]). A connection to a database that
    /// went silent is then found within `acquire_timeout` rather than at [`QUERY_DEADLINE`]: the
    /// API sets it, so that a client waiting on a stalled database gets its 503 in seconds. A
    /// loop's kept connection ([`Kept`]) is checked only after a second idle even then: a loop's
    /// work has its own deadline.
    pub check_each_acquire: bool,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            timeouts: DbTimeouts::default(),
            check_each_acquire: false,
        }
    }
}

/// How a service that owns a database (migrates it) reaches it beside its `DATABASE_URL`: the
/// schema owner's URL, the relay's role, and the server-side bounds.
#[derive(Debug, Clone, clap::Args)]
pub struct SchemaArgs {
    /// Postgres URL of the same database as the role that owns its schema, to apply the
    /// migrations with; unset, they run as DATABASE_URL.
    #[arg(long, env = "MIGRATION_DATABASE_URL", hide_env_values = true)]
    pub migration_database_url: Option<SecretUrl>,
    /// The relay's database role, granted SELECT, UPDATE and DELETE on the outbox after the
    /// migrations (by the migrating role); unset, no grant is made.
    #[arg(long, env = "OUTBOX_RELAY_ROLE")]
    pub outbox_relay_role: Option<String>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub timeouts: DbTimeouts,
}

impl SchemaArgs {
    /// The database at `url` (the runtime role's), as these settings say to open it.
    pub fn database<'a>(&'a self, url: &'a SecretUrl) -> Database<'a> {
        Database {
            url,
            migrate_as: self.migration_database_url.as_ref(),
            relay_role: self.outbox_relay_role.as_deref(),
        }
    }
}

/// Where a service's database is: the URL it runs as, and optionally another it migrates as (the
/// schema's owner, when the runtime role may not change the schema).
#[derive(Debug, Clone)]
pub struct Database<'a> {
    /// The runtime role's URL (`DATABASE_URL`).
    pub url: &'a SecretUrl,
    /// The migrating role's URL (`MIGRATION_DATABASE_URL`); the runtime URL if none.
    pub migrate_as: Option<&'a SecretUrl>,
    /// The relay's role (`OUTBOX_RELAY_ROLE`), granted what it needs on the outbox once the
    /// migrations have run, by the migrating role: `SELECT`, `UPDATE`, `DELETE`.
    pub relay_role: Option<&'a str>,
}

/// Connect, create the database if it is missing and the role may, apply messaging's migrations
/// and then the service's `migrator` ([`messaging_core::schema::migrate`]), and check that the runtime role
/// holds every grant the service needs. Retries with backoff, from the start, while the server
/// cannot be reached (it may still be starting) or a connection is lost midway. Anything that no wait would cure (a certificate that does not
/// verify, bad credentials, a bad migration, a missing grant) is a [`StartupError`] naming the
/// server and what is wrong. `Ok(None)` if shutdown came first.
pub async fn open(
    database: Database<'_>,
    migrator: &Migrator,
    settings: PoolSettings,
    shutdown: &Shutdown,
) -> Result<Option<PgPool>, StartupError> {
    let at = |url: &SecretUrl, error: &dyn std::fmt::Display| StartupError(format!("the database at {url}: {error}"));
    let options = PgConnectOptions::from_str(database.url.expose()).map_err(|e| at(database.url, &e))?;
    let migrating_url = database.migrate_as.unwrap_or(database.url);
    let migrating = PgConnectOptions::from_str(migrating_url.expose()).map_err(|e| at(migrating_url, &e))?;
    for url in [database.url, migrating_url] {
        if let Some(reason) = crate::runtime::tls::unreadable_postgres_file(url.expose()) {
            return Err(at(url, &reason));
        }
    }
    let backoff = Backoff::default();
    let mut failures = 0;
    loop {
        let step = async {
            create_database_if_missing(&migrating).await.map_err(|e| (migrating_url, e))?;
            migrate(&migrating, migrator).await.map_err(|e| (migrating_url, e))?;
            if let Some(role) = database.relay_role {
                grant_outbox(&migrating, role).await.map_err(|e| (migrating_url, e))?;
            }
            let pool = pool_options(settings.max_connections, settings.acquire_timeout, settings.check_each_acquire)
                .connect_with(bounded(options.clone(), &settings.timeouts))
                .await
                .map_err(|e| (database.url, e))?;
            check_grants(&pool, &FULL_ACCESS).await.map_err(|e| (database.url, e))?;
            Ok::<_, (&SecretUrl, sqlx::Error)>(pool)
        };
        match step.await {
            Ok(pool) => return Ok(Some(pool)),
            Err((url, error)) if is_unreachable(&error) => {
                let delay = backoff.delay(failures);
                tracing::warn!(%error, %url, ?delay, "cannot reach the database; retrying");
                failures += 1;
                if !shutdown.sleep(delay).await {
                    return Ok(None);
                }
            }
            Err((url, error)) => return Err(at(url, &describe(&error))),
        }
    }
}

/// Apply the migrations on a connection of its own: a migration may rightly run longer than any
/// statement of ours. A role that may not change the schema (a runtime role without
/// `MIGRATION_DATABASE_URL`) starts if nothing is left to apply, and is told which versions are
/// pending otherwise.
async fn migrate(options: &PgConnectOptions, migrator: &Migrator) -> Result<(), sqlx::Error> {
    let migrating = PgPoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
    let migrated = messaging_core::schema::migrate(&migrating, migrator).await;
    let denied = |error: &MigrateError| match error {
        MigrateError::Execute(sqlx::Error::Database(e))
        | MigrateError::ExecuteMigration(sqlx::Error::Database(e), _)
            if e.code().as_deref() == Some("42501") =>
        {
            Some(e.message().to_owned())
        }
        _ => None,
    };
    let outcome = match migrated {
        Err(error) => match denied(&error) {
            None => Err(sqlx::Error::from(error)),
            Some(message) => match messaging_core::schema::pending(&migrating, migrator).await {
                Ok(pending) if pending.is_empty() => Ok(()),
                Ok(pending) => Err(sqlx::Error::Configuration(
                    format!(
                        "role {} may not apply the pending migrations {pending:?} ({message}): run them as the \
                         schema's owner (MIGRATION_DATABASE_URL, docs/operations.md)",
                        options.get_username()
                    )
                    .into(),
                )),
                Err(error) => Err(sqlx::Error::from(error)),
            },
        },
        Ok(()) => Ok(()),
    };
    migrating.close().await;
    outcome
}

/// Grant the relay's `role` its rights on the outbox (idempotent), as the outbox's owner.
async fn grant_outbox(options: &PgConnectOptions, role: &str) -> Result<(), sqlx::Error> {
    let mut owner = PgConnection::connect_with(options).await?;
    let grant = format!("grant select, update, delete on outbox to \"{}\"", role.replace('"', "\"\""));
    // A role name cannot be a bound parameter; it is quoted as an identifier above.
    let granted = sqlx::query(AssertSqlSafe(grant)).execute(&mut owner).await;
    let _ = owner.close().await;
    match granted {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42501" | "42704")) => {
            Err(sqlx::Error::Configuration(
                format!(
                    "role {} cannot grant OUTBOX_RELAY_ROLE={role} its rights on the outbox ({}): migrate as the \
                     outbox's owner (MIGRATION_DATABASE_URL), and create the role first (ops/postgres/roles.sql)",
                    options.get_username(),
                    e.message()
                )
                .into(),
            ))
        }
        Err(error) => Err(error),
    }
}

/// One line for a start-up error: rustls' reason for a certificate, else sqlx's message.
pub fn describe(error: &sqlx::Error) -> String {
    match (messaging_core::outage::verification_failure(error), error) {
        (Some(reason), _) => format!("TLS: {reason}"),
        // Ours (a missing grant, a role that may not migrate): the message alone.
        (None, sqlx::Error::Configuration(message)) => message.to_string(),
        (None, error) => error.to_string(),
    }
}

/// The table privileges a service's runtime role needs on every table of its database.
pub const FULL_ACCESS: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

/// The privileges in `needed` that the connected role lacks on the tables of the `public` schema
/// (the migrations' bookkeeping table aside), as an error naming each: `role inventory lacks
/// INSERT on inbox`. The check runs once at start-up, so that a missing grant is reported by name
/// instead of as the first failed delivery.
pub async fn check_grants(pool: &PgPool, needed: &[&str]) -> Result<(), sqlx::Error> {
    let tables: Vec<String> = sqlx::query_scalar(
        "select tablename::text from pg_tables where schemaname = 'public' and tablename <> '_sqlx_migrations'
         order by tablename",
    )
    .fetch_all(pool)
    .await?;
    check_table_grants(pool, &tables, needed).await
}

/// [`check_grants`] on the named tables only.
pub async fn check_table_grants(pool: &PgPool, tables: &[String], needed: &[&str]) -> Result<(), sqlx::Error> {
    let (role, missing): (String, Vec<String>) = sqlx::query_as(
        "select current_user::text,
                coalesce(array_agg(p || ' on ' || t order by t, ord) filter (where not has_table_privilege(t, p)), '{}')
         from unnest($1::text[]) as t, unnest($2::text[]) with ordinality as n(p, ord)",
    )
    .bind(tables)
    .bind(needed)
    .fetch_one(pool)
    .await?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(sqlx::Error::Configuration(
        format!(
            "role {role} lacks {} (grant them, or run ops/postgres/roles.sql: docs/operations.md)",
            missing.join(", ")
        )
        .into(),
    ))
}

/// `CREATE DATABASE` if the database named in `options` does not exist, through the `postgres`
/// maintenance database. The database is looked for first by connecting to it, so a role that may
/// not use the maintenance database still starts when its database exists; one that may not
/// create a missing database gets an error that says so.
pub async fn create_database_if_missing(options: &PgConnectOptions) -> Result<(), sqlx::Error> {
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    match PgConnection::connect_with(options).await {
        Ok(connection) => return connection.close().await,
        // 3D000 invalid_catalog_name: the database does not exist.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("3D000") => {}
        Err(error) => return Err(error),
    }
    let mut admin = PgConnection::connect_with(&options.clone().database("postgres")).await?;
    let create = format!("create database \"{}\"", name.replace('"', "\"\""));
    // A database name cannot be a bound parameter; it is quoted as an identifier above.
    let created = sqlx::query(AssertSqlSafe(create)).execute(&mut admin).await;
    let _ = admin.close().await;
    match created {
        Ok(_) => {
            tracing::info!(database = %name, "created database");
            Ok(())
        }
        // Another instance won the race: duplicate_database, or unique_violation on pg_database.
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42P04" | "23505")) => Ok(()),
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") => Err(sqlx::Error::Configuration(
            format!(
                "database {name} does not exist and role {} may not create it (CREATEDB): a DBA creates it, \
                 e.g. with ops/postgres/roles.sql (docs/operations.md)",
                options.get_username()
            )
            .into(),
        )),
        Err(error) => Err(error),
    }
}
