//! `msgctl outbox …`: rows the relay could not get the broker to take (returned as unroutable,
//! nacked, or refused by closing the channel), which it retries with a growing backoff, and the
//! rows it parked after `RELAY_MAX_ATTEMPTS` refusals; a way to send them again now, and one to
//! give a parked row up for good, ending its job through the saga.

use std::str::FromStr;

use chrono::{DateTime, Utc};
use messaging::{
    contracts::JobAbandoned,
    envelope::Headers,
    outbox::NOTIFY_CHANNEL,
    publisher::Publisher,
    runtime::{
        broker,
        config::{BrokerNodes, SecretUrl},
    },
};
use sqlx::{
    PgPool,
    postgres::{PgConnectOptions, PgPoolOptions},
};
use uuid::Uuid;

use crate::{
    Failure,
    parked::{Unroutable, send_job_event},
};

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
    /// Give parked rows up for good (by message id), when no fix will get the broker to take
    /// them: the job of each (its correlation id) is abandoned first with a confirmed
    /// `job.abandoned`, so that its owner ends it and undoes what its steps did (an order:
    /// cancelled, its stock given back), then the row is deleted. Refused, deleting nothing, for a
    /// row that is not parked (the relay may still send it) and for an undo (`order.ended`,
    /// `inventory.released`, `invoice.voided`: nothing would send it again).
    Discard {
        /// Message ids of parked rows.
        #[arg(required = true)]
        message_ids: Vec<Uuid>,
        /// Why, for the job's record.
        #[arg(long, default_value = "discarded with msgctl")]
        note: String,
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

pub async fn run(action: Action, databases: &[SecretUrl], nodes: &BrokerNodes) -> Result<(), Failure> {
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
        Action::Discard { message_ids, note } => discard(&pools, &message_ids, &note, nodes).await,
    }
}

/// A row named for `discard`, as its database holds it.
#[derive(Debug, sqlx::FromRow)]
struct Named {
    message_id: Uuid,
    message_type: String,
    parked_at: Option<DateTime<Utc>>,
    headers: sqlx::types::Json<Headers>,
}

/// Discard the named rows. Each database's rows are locked (`FOR UPDATE`) in a transaction held
/// until they are deleted, so that none is re-armed (`retry`) and published between the check and
/// the delete: the relay's claim skips a locked row, and a `retry` waits for it.
async fn discard(
    pools: &[(String, PgPool)],
    message_ids: &[Uuid],
    note: &str,
    nodes: &BrokerNodes,
) -> Result<(), Failure> {
    // Every row checked before anything is sent or deleted.
    let mut named: Vec<(usize, Named)> = Vec::new();
    let mut locked = Vec::new();
    for (database, pool) in pools {
        let mut tx = pool.begin().await?;
        let rows: Vec<Named> = sqlx::query_as(
            "select message_id, message_type, parked_at, headers from outbox
              where message_id = any($1) and published_at is null
                for update",
        )
        .bind(message_ids)
        .fetch_all(&mut *tx)
        .await
        .map_err(|error| Failure::Described(format!("{database}: {error}")))?;
        named.extend(rows.into_iter().map(|row| (locked.len(), row)));
        locked.push(tx);
    }
    let found: Vec<Uuid> = named.iter().map(|(_, row)| row.message_id).collect();
    refuse_missing(message_ids, &found)?;
    for (at, row) in &named {
        let database = &pools[*at].0;
        let refusal = if row.parked_at.is_none() {
            Some("it is not parked: the relay still sends it (`msgctl outbox stuck` says when)")
        } else if shop::is_undo(&row.message_type) {
            Some("it undoes an ended order's steps, and nothing would send it again: its job would stay compensating")
        } else {
            None
        };
        if let Some(why) = refusal {
            return Err(Failure::Described(format!(
                "cannot discard {database} {} ({}): {why}; nothing was discarded",
                row.message_id, row.message_type
            )));
        }
    }
    let (connection, _) = broker::connect_any(nodes, 0, "msgctl")
        .await
        .map_err(|error| Failure::Described(format!("cannot reach the broker at {nodes}: {error}")))?;
    let publisher = Publisher::open(&connection).await?;
    let mut discarded = 0;
    for (at, row) in &named {
        let database = &pools[*at].0;
        if let Some(job_id) = row.headers.0.correlation_id {
            let event = JobAbandoned {
                job_id,
                endpoint: format!("outbox:{database}"),
                message_id: row.message_id,
                reason: note.to_owned(),
            };
            // Nothing is deleted unless its job's owner took the event.
            // Refused rather than unroutable: no warning comes back.
            send_job_event(&publisher, &event, Unroutable::Refuse).await?;
        }
        // Gone at the commit below. The job's owner, deciding its end meanwhile, finds the row
        // locked and takes it as lost (the orders service, its own order.placed: `SKIP LOCKED`).
        sqlx::query("delete from outbox where message_id = $1").bind(row.message_id).execute(&mut *locked[*at]).await?;
        println!("{database}  {}  {}  discarded", row.message_id, row.message_type);
        discarded += 1;
    }
    for tx in locked {
        tx.commit().await?;
    }
    publisher.close().await;
    let _ = connection.close(200, "bye".into()).await;
    println!("{discarded} row(s) discarded");
    Ok(())
}

/// Fail, naming them, if any of the `asked` message ids is not among the unpublished rows `found`.
fn refuse_missing(asked: &[Uuid], found: &[Uuid]) -> Result<(), Failure> {
    let missing: Vec<String> = asked.iter().filter(|id| !found.contains(id)).map(ToString::to_string).collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Failure::Described(format!("no unpublished outbox row with message id {}", missing.join(", "))))
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
              where ($1 and ((published_at is null and not scheduled and attempts > 0)
                             or (published_at is null and scheduled and attempts > 0)))
                 or (message_id = any($2) and published_at is null)
              returning message_id",
        )
        .bind(all)
        .bind(message_ids)
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
    refuse_missing(message_ids, &found)?;
    if found.is_empty() {
        return Err(Failure::Described("nothing selected: no stuck row".into()));
    }
    println!("{} row(s) due now", found.len());
    Ok(())
}
