//! `msgctl outbox …`: rows the relay could not get the broker to take (returned as unroutable,
//! nacked, or refused by closing the channel), which it retries with a growing backoff, and the
//! rows it parked after `RELAY_MAX_ATTEMPTS` refusals; and a way to send them again now.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use messaging::{outbox::NOTIFY_CHANNEL, runtime::config::SecretUrl};
use sqlx::{
    PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use uuid::Uuid;

use crate::Failure;

#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Unpublished rows the broker refused at least once, oldest first, with their last error:
    /// `waiting` for their next attempt, or `parked` (the relay skips them until they are re-armed).
    Stuck {
        /// One JSON object per row, one per line.
        #[arg(long)]
        json: bool,
    },
    /// Make the named rows (by message id), or every stuck row, due now; the relay sends them on
    /// its next round. A parked row is re-armed, with a fresh set of attempts: fix what the broker
    /// refused first (`lastError` says what).
    Retry {
        /// Message ids of unpublished rows.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        message_ids: Vec<Uuid>,
        /// Every stuck row.
        #[arg(long)]
        all: bool,
    },
}

/// A stuck row.
#[derive(Debug, sqlx::FromRow)]
struct Stuck {
    id: i64,
    message_id: Uuid,
    message_type: String,
    exchange: String,
    routing_key: String,
    attempts: i32,
    /// Of those, publishes the broker refused by closing the channel: what parks a row.
    refusals: i32,
    last_error: Option<String>,
    available_at: DateTime<Utc>,
    created_at: DateTime<Utc>,
    parked_at: Option<DateTime<Utc>>,
}

pub async fn run(action: Action, databases: &[SecretUrl]) -> Result<(), Failure> {
    if databases.is_empty() {
        return Err(Failure::Described(
            "no outbox database: set DATABASE_URL (comma-separated, as for the relay)".into(),
        ));
    }
    let mut pools = Vec::new();
    for url in databases {
        pools.push(connect(url).await?);
    }
    match action {
        Action::Stuck { json } => stuck(&pools, json).await,
        Action::Retry { message_ids, all } => retry(&pools, &message_ids, all).await,
    }
}

/// A one-connection pool on `url`, with the database's name as the relay labels it.
async fn connect(url: &SecretUrl) -> Result<(String, PgPool), Failure> {
    let options =
        PgConnectOptions::from_str(url.expose()).map_err(|error| Failure::Described(format!("{url}: {error}")))?;
    let label = options.get_database().unwrap_or("postgres").to_owned();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(std::time::Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(|error| Failure::Described(format!("cannot reach the database at {url}: {error}")))?;
    Ok((label, pool))
}

async fn stuck(pools: &[(String, PgPool)], json: bool) -> Result<(), Failure> {
    let mut total = 0;
    for (database, pool) in pools {
        let rows: Vec<Stuck> = sqlx::query_as(
            "select id, message_id, message_type, exchange, routing_key, attempts, refusals, last_error, available_at,
                    created_at, parked_at
               from outbox
              where (published_at is null and not scheduled and attempts > 0)
                 or (published_at is null and scheduled and attempts > 0)
              order by id",
        )
        .fetch_all(pool)
        .await
        .map_err(|error| Failure::Described(format!("{database}: {error}")))?;
        for row in &rows {
            let state = if row.parked_at.is_some() { "parked" } else { "waiting" };
            if json {
                let line = serde_json::json!({
                    "database": database, "id": row.id, "messageId": row.message_id, "type": row.message_type,
                    "exchange": row.exchange, "routingKey": row.routing_key, "attempts": row.attempts,
                    "refusals": row.refusals,
                    "lastError": row.last_error, "nextAttemptAt": row.available_at, "createdAt": row.created_at,
                    "state": state, "parkedAt": row.parked_at,
                });
                println!("{line}");
            } else {
                let next = match row.parked_at {
                    Some(parked_at) => format!("parked {}", parked_at.to_rfc3339()),
                    None => format!("next {}", row.available_at.to_rfc3339()),
                };
                println!(
                    "{database}  {}  {}  to {}/{}  attempts {} (refused {})  {next}  {}",
                    row.message_id,
                    row.message_type,
                    row.exchange,
                    row.routing_key,
                    row.attempts,
                    row.refusals,
                    row.last_error.as_deref().unwrap_or("-")
                );
            }
        }
        total += rows.len();
    }
    if !json {
        println!("{total} stuck row(s)");
    }
    Ok(())
}

async fn retry(pools: &[(String, PgPool)], message_ids: &[Uuid], all: bool) -> Result<(), Failure> {
    let mut found = Vec::new();
    for (database, pool) in pools {
        let made_due: Vec<Uuid> = sqlx::query_scalar(
            // Each predicate on one of the partial indexes of unpublished rows (plain, scheduled),
            // or the message ids' unique index: never the whole table. A scheduled row that has not
            // failed keeps its due time (an order's deadline is not brought forward).
            "update outbox
                set available_at = case when scheduled and attempts = 0 then available_at else now() end,
                    parked_at = null,
                    attempts = case when parked_at is null then attempts else 0 end,
                    refusals = case when parked_at is null then refusals else 0 end
              where ($2 and ((published_at is null and not scheduled and attempts > 0)
                             or (published_at is null and scheduled and attempts > 0)))
                 or (message_id = any($1) and published_at is null)
              returning message_id",
        )
        .bind(message_ids)
        .bind(all)
        .fetch_all(pool)
        .await
        .map_err(|error| Failure::Described(format!("{database}: {error}")))?;
        if !made_due.is_empty() {
            // Wake the relay now rather than at its next poll.
            sqlx::query("select pg_notify($1, '')").bind(NOTIFY_CHANNEL).execute(pool).await?;
        }
        for message_id in &made_due {
            println!("{database}  {message_id}  due now");
        }
        found.extend(made_due);
    }
    let missing: Vec<String> = message_ids.iter().filter(|id| !found.contains(id)).map(ToString::to_string).collect();
    if !missing.is_empty() {
        return Err(Failure::Described(format!("no unpublished outbox row with message id {}", missing.join(", "))));
    }
    if found.is_empty() {
        return Err(Failure::Described("nothing selected: no stuck row".into()));
    }
    println!("{} row(s) due now", found.len());
    Ok(())
}
