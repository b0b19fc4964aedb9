//! What an upgrade from a release before the saga leaves to do (issue 56, row 3; migration 0012).
//!
//! Before the saga (decision 0023) no order was announced at its end and none had a deadline, and
//! inventory's migration 0005 made every reservation `held`. Migration 0012 lists what each order
//! placed before the saga is owed, in `upgrade_backlog`: an invoiced one its `order.ended`
//! (inventory settles its reservation), one not ended yet its `order.deadline`, `ORDER_DEADLINE`
//! from when it is sent (it ends by then, or is cancelled and gives its stock back). This task
//! sends them through the outbox, a batch per transaction that deletes the batch's rows, so that
//! each is sent once whatever number of instances run it, and stops when the table is empty. On a
//! database created after the saga it finds nothing at its first look.
//!
//! It does not flood the relay: while more than 1,000 due rows wait to be published, it waits,
//! so that the orders placed meanwhile are not queued behind a history of announcements.

use std::time::{Duration, Instant};

use chrono::Utc;
use messaging::{
    outbox::Outgoing,
    runtime::{backoff::Backoff, shutdown::Shutdown},
};
use shop::{End, OrderEnded};
use sqlx::PgPool;
use uuid::Uuid;

use crate::place::ScheduledDeadline;

/// Rows of `upgrade_backlog` sent in one transaction.
const BATCH: i64 = 200;
/// While more due outbox rows than this wait to be published, the backlog waits.
const OUTBOX_AHEAD: i64 = 1_000;
/// How long the backlog waits (for the relay, or for another instance's batch) before it looks
/// again.
const PAUSE: Duration = Duration::from_secs(1);
/// How often a wait for the relay is logged while it lasts.
const LOG_WAIT_EVERY: Duration = Duration::from_secs(60);

/// Send what the backlog owes, in the background, until it is empty or `shutdown`. A failure (the
/// database away) is retried with backoff; what is left stays in the table for the next try, or
/// the next start.
pub fn start(pool: PgPool, order_deadline: Duration, shutdown: Shutdown) {
    tokio::spawn(async move {
        let backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        let (mut failures, mut sent, mut logged_wait) = (0u32, Sent::default(), None::<Instant>);
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
                // Rows another instance is sending; or its batch rolled back (it waits too).
                Ok(Step::Taken) => PAUSE,
                Ok(Step::RelayBehind) => {
                    if logged_wait.is_none_or(|at| at.elapsed() >= LOG_WAIT_EVERY) {
                        logged_wait = Some(Instant::now());
                        tracing::info!(
                            "the upgrade's backlog waits: over {OUTBOX_AHEAD} due outbox rows are unpublished (is a relay running?)"
                        );
                    }
                    PAUSE
                }
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
    /// Every row left is being sent by another instance.
    Taken,
    /// Too many due outbox rows wait for the relay; nothing was sent.
    RelayBehind,
}

/// Messages sent for the backlog.
#[derive(Debug, Default, PartialEq, Eq)]
struct Sent {
    ended: u64,
    deadlines: u64,
}

/// A row of `upgrade_backlog`.
#[derive(Debug, sqlx::FromRow)]
struct Owed {
    order_id: Uuid,
    job_id: Uuid,
    owed: String,
}

async fn step(pool: &PgPool, order_deadline: Duration) -> Result<Step, sqlx::Error> {
    let mut tx = pool.begin().await?;
    // Due rows (a scheduled one whose time has come is claimed like any other), parked ones aside.
    let waiting: i64 = sqlx::query_scalar(
        "select count(*) from (
            select from outbox where published_at is null and parked_at is null
               and (not scheduled or available_at <= now())
             limit $1) w",
    )
    .bind(OUTBOX_AHEAD + 1)
    .fetch_one(&mut *tx)
    .await?;
    if waiting > OUTBOX_AHEAD {
        return Ok(Step::RelayBehind);
    }
    let owed: Vec<Owed> = sqlx::query_as(
        "delete from upgrade_backlog where order_id in (
            select order_id from upgrade_backlog order by order_id limit $1 for update skip locked)
         returning order_id, job_id, owed",
    )
    .bind(BATCH)
    .fetch_all(&mut *tx)
    .await?;
    if owed.is_empty() {
        let left: bool = sqlx::query_scalar("select exists (select from upgrade_backlog)").fetch_one(&mut *tx).await?;
        return Ok(if left { Step::Taken } else { Step::Done });
    }
    // A new order's time, from now: an order in flight across the upgrade (held up by it,
    // perhaps) or parked long ago gets the time to end that it never had.
    let at = Utc::now() + chrono::Duration::from_std(order_deadline).unwrap_or(chrono::TimeDelta::MAX);
    let mut sent = Sent::default();
    for Owed { order_id, job_id, owed } in owed {
        if owed == "ended" {
            // Unordered: the order's `order.placed` went out before ordering per key existed, so
            // inventory has no turn of this key to wait for.
            let ended = OrderEnded { order_id, job_id, end: End::Invoiced, reason: None };
            Outgoing::of(&ended, Some(job_id)).enqueue(&mut tx).await?;
            sent.ended += 1;
        } else {
            ScheduledDeadline::new(order_id, job_id, at).row().enqueue(&mut tx).await?;
            sent.deadlines += 1;
        }
    }
    tx.commit().await?;
    Ok(Step::Sent(sent))
}
