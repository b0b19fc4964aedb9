//! Database start-up: create the service's database if it is missing, connect a pool, migrate.
//! Safe when several instances start together: `CREATE DATABASE` races are tolerated and sqlx's
//! migrator holds an advisory lock while it migrates.
//!
//! Every query is bounded twice (docs/guarantees.md, "stalled database"): the server cancels a
//! statement after [`STATEMENT_TIMEOUT`], and the client gives up after [`QUERY_DEADLINE`] on work
//! wrapped in [`within`], which also covers a connection that has gone silent (a black hole, where
//! the server's cancel never arrives and the kernel would wait about 15 minutes).

use std::{future::Future, str::FromStr, time::Duration};

use sqlx::{
    Connection, PgConnection, PgPool,
    migrate::Migrator,
    postgres::{PgConnectOptions, PgPoolOptions},
};

use crate::{backoff::Backoff, config::SecretUrl, shutdown::Shutdown};

/// Set on every pooled connection: the server cancels a statement running longer (SQLSTATE 57014,
/// a transient error). Migrations run on a connection of their own, without it.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the client waits for one unit of database work (a transaction, a batch) wrapped in
/// [`within`] before it gives up and treats the database as unreachable.
pub const QUERY_DEADLINE: Duration = Duration::from_secs(10);

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
            format!("no answer from the database within {}", crate::duration::format_duration(limit)),
        )))),
    }
}

/// Whether the database answers a trivial query within two seconds.
pub async fn answers(pool: &PgPool) -> bool {
    within(Duration::from_secs(2), sqlx::query("select 1").execute(pool)).await.is_ok()
}

/// `options` with the [`STATEMENT_TIMEOUT`] every pooled connection gets.
pub fn bounded(options: PgConnectOptions) -> PgConnectOptions {
    options.options([("statement_timeout", STATEMENT_TIMEOUT.as_millis())])
}

/// Pool settings.
#[derive(Debug, Clone, Copy)]
pub struct PoolSettings {
    /// Connections at most.
    pub max_connections: u32,
    /// How long a caller waits for a free connection before getting an error (which the API turns
    /// into a 503 and the consumers into a retry) instead of hanging.
    pub acquire_timeout: Duration,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self { max_connections: 10, acquire_timeout: Duration::from_secs(5) }
    }
}

/// Create the database named in `url` if missing, connect, and apply messaging's migrations and
/// then the service's `migrator` ([`crate::schema::migrate`]). Retries with
/// backoff while the server cannot be reached (it may still be starting); other errors (a bad
/// migration, bad credentials) are returned at once. `Ok(None)` if shutdown came first.
pub async fn open(
    url: &SecretUrl,
    migrator: &Migrator,
    settings: PoolSettings,
    shutdown: &Shutdown,
) -> Result<Option<PgPool>, sqlx::Error> {
    let options = PgConnectOptions::from_str(url.expose())?;
    let backoff = Backoff::default();
    let mut failures = 0;
    loop {
        match try_open(&options, migrator, settings).await {
            Ok(pool) => return Ok(Some(pool)),
            Err(error) if is_unreachable(&error) => {
                let delay = backoff.delay(failures);
                tracing::warn!(%error, %url, ?delay, "cannot reach the database; retrying");
                failures += 1;
                if !shutdown.sleep(delay).await {
                    return Ok(None);
                }
            }
            Err(error) => return Err(error),
        }
    }
}

async fn try_open(
    options: &PgConnectOptions,
    migrator: &Migrator,
    settings: PoolSettings,
) -> Result<PgPool, sqlx::Error> {
    create_database_if_missing(options).await?;
    // A migration may rightly run longer than any statement of ours: its connection is unbounded.
    let migrating = PgPoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
    crate::schema::migrate(&migrating, migrator).await?;
    migrating.close().await;
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        .connect_with(bounded(options.clone()))
        .await
}

/// `CREATE DATABASE` if the database named in `options` does not exist, through the `postgres`
/// maintenance database.
pub async fn create_database_if_missing(options: &PgConnectOptions) -> Result<(), sqlx::Error> {
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    let mut admin = PgConnection::connect_with(&options.clone().database("postgres")).await?;
    let exists: bool = sqlx::query_scalar("select exists (select 1 from pg_database where datname = $1)")
        .bind(&name)
        .fetch_one(&mut admin)
        .await?;
    if !exists {
        let create = format!("create database \"{}\"", name.replace('"', "\"\""));
        match sqlx::query(&create).execute(&mut admin).await {
            Ok(_) => tracing::info!(database = %name, "created database"),
            // Another instance won the race: duplicate_database, or unique_violation on pg_database.
            Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("42P04" | "23505")) => {}
            Err(error) => return Err(error),
        }
    }
    admin.close().await
}

/// Whether an error means "the server is not there (yet)", worth waiting for.
pub fn is_unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => true,
        // Class 08 is connection trouble; 57P01-57P03 are the server shutting down, crashing or
        // starting up.
        sqlx::Error::Database(e) => {
            e.code().is_some_and(|code| code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P03"))
        }
        _ => false,
    }
}
