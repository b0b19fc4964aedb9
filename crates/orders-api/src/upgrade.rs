//! What an upgrade from a release before the saga leaves to do (issue 56, row 3; migration 0012).
//!
//! Before the saga (decision 0023) no order was announced at its end and none had a deadline, and
//! inventory's migration 0005 made every reservation `held`. Migration 0012 lists what each order
//! placed before the saga is owed, in `upgrade_backlog`: an invoiced one its `order.ended`
//! (inventory settles its reservation), one not ended yet its `order.deadline` (it ends by then,
//! or is cancelled and gives its stock back). This task sends them through the outbox, a batch
//! per transaction that deletes the batch's rows, so that each is sent once whatever number of
//! instances run it, and stops when the table is empty. On a database created after the saga it
//! finds nothing at its first look.
//!
//! It does not flood the relay: while more than [`OUTBOX_AHEAD`] due rows wait to be published,
//! it waits, so that the orders placed meanwhile are not queued behind a history of announcements.

use std::time::Duration;

use chrono::{DateTime, Utc};
use messaging::{
    outbox::Outgoing,
    runtime::{backoff::Backoff, shutdown::Shutdown},
};
use shop::{End, OrderDeadline, OrderEnded};
use sqlx::PgPool;
use uuid::Uuid;

/// Rows of `upgrade_backlog` sent in one transaction.
const BATCH: i64 = 200;
/// While more outbox rows than this wait to be published, the backlog waits.
const OUTBOX_AHEAD: i64 = 1_000;
/// How long the backlog waits for the relay to catch up before it looks again.
const WAIT_FOR_RELAY: Duration = Duration::from_secs(1);

/// Send what the backlog owes, in the background, until it is empty or `shutdown`. A failure (the
/// database away) is retried with backoff; what is left stays in the table for the next try, or
/// the next start.
pub fn start(pool: PgPool, order_deadline: Duration, shutdown: Shutdown) {
    tokio::spawn(async move {
        let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        let (mut failures, mut sent) = (0u32, Sent::default());
        loop {
            let step = tokio::select! {
                step = step(&pool, order_deadline) => step,
                () = shutdown.triggered() => return,
            };
            let pause = match step {
                Ok(Step::Sent(batch)) => {
                    failures = 0;
                    sent.ended += batch.ended;
                    sent.deadlines += batch.deadlines;
                    continue;
                }
                Ok(Step::Done) => {
                    if sent != Sent::default() {
                        tracing::info!(
                            ended = sent.ended,
                            deadlines = sent.deadlines,
                            "the upgrade's backlog is sent: orders placed before the saga are announced"
                        );
                    }
                    return;
                }
                Ok(Step::RelayBehind) => WAIT_FOR_RELAY,
                Err(error) => {
                    tracing::warn!(%error, "the upgrade's backlog could not be sent; trying again");
                    failures += 1;
                    backoff.delay(failures - 1)
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = shutdown.triggered() => return,
            }
        }
    });
}

/// What one look at the backlog did.
#[derive(Debug)]
enum Step {
    /// A batch was sent.
    Sent(Sent),
    /// The backlog is empty.
    Done,
    /// Too many outbox rows wait for the relay; nothing was sent.
    RelayBehind,
}

/// Messages sent for the backlog.
#[derive(Debug, Default, PartialEq, Eq)]
struct Sent {
    ended: u64,
    deadlines: u64,
}

/// A row of `upgrade_backlog`, with its order's creation.
#[derive(Debug, sqlx::FromRow)]
struct Owed {
    order_id: Uuid,
    job_id: Uuid,
    owed: String,
    created_at: DateTime<Utc>,
}

async fn step(pool: &PgPool, order_deadline: Duration) -> Result<Step, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let owed: Vec<Owed> = sqlx::query_as(
        "delete from upgrade_backlog b using orders o
          where b.order_id = o.id and b.order_id in (
                select order_id from upgrade_backlog order by order_id limit $1 for update skip locked)
         returning b.order_id, b.job_id, b.owed, o.created_at",
    )
    .bind(BATCH)
    .fetch_all(&mut *tx)
    .await?;
    if owed.is_empty() {
        // Rows held by another instance are its to send; an empty look is the end for this one.
        return Ok(Step::Done);
    }
    // Due rows only (a scheduled `order.deadline` waits for its time, not for the relay), parked
    // ones aside; by the index of the relay's claim.
    let waiting: i64 = sqlx::query_scalar(
        "select count(*) from (
            select from outbox where published_at is null and not scheduled and parked_at is null limit $1) w",
    )
    .bind(OUTBOX_AHEAD + 1)
    .fetch_one(&mut *tx)
    .await?;
    if waiting > OUTBOX_AHEAD {
        tx.rollback().await?;
        return Ok(Step::RelayBehind);
    }
    let deadline = chrono::Duration::from_std(order_deadline).unwrap_or(chrono::TimeDelta::MAX);
    let mut sent = Sent::default();
    for Owed { order_id, job_id, owed, created_at } in owed {
        if owed == "ended" {
            // Unordered: the order's `order.placed` went out before ordering per key existed, so
            // inventory has no turn of this key to wait for.
            let ended = OrderEnded { order_id, job_id, end: End::Invoiced, reason: None };
            Outgoing::of(&ended, Some(job_id)).enqueue(&mut tx).await?;
            sent.ended += 1;
        } else {
            // Its deadline as a new order would have it, and never in the past: an order in
            // flight at the upgrade gets the time it would have had.
            let at = (created_at.checked_add_signed(deadline).unwrap_or(DateTime::<Utc>::MAX_UTC)).max(Utc::now());
            let body = OrderDeadline { order_id, job_id };
            Outgoing::of(&body, Some(job_id)).at(at).enqueue(&mut tx).await?;
            sent.deadlines += 1;
        }
    }
    tx.commit().await?;
    Ok(Step::Sent(sent))
}
