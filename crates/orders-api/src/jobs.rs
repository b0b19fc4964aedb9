//! Jobs: what a client polls (`GET /jobs/{id}`), and every move of their state, in one place.
//!
//! Every move a job's state may make is in one table, [`crate::moves::MOVES`], each with what
//! makes it; each statement below makes some of them, guarded in SQL. In short: `queued` is
//! published by the broker's confirm; a step's retry waits in `retry_wait` until that step
//! succeeds; a parked message quarantines the job until its redrive; any undecided job may be
//! decided (`rejected`, `succeeded`, or `compensating` until both undos answer, then `declined` or
//! `cancelled`). The model (`docs/model/jobs.pml`) and the database (migration 0014, which counts
//! any other move) are checked against the same table.
//!
//! Undecided is every state but [`JobState::DECIDED`]'s; quarantined is among them. Every move is
//! monotonic, so late or reordered events are harmless: a decided job never takes another end,
//! `quarantined` changes only by a redrive or an end, attempt numbers only grow, and a late retry
//! event of a step that has already succeeded changes nothing. Which step's message is parked,
//! and how often it was redriven, is kept per step (`job_steps`), so a redrive of one step's
//! message neither reopens a job that another step's parked message holds nor loses to a redrive
//! of another step. `docs/model/jobs.pml` checks these moves against every order of events, and
//! `docs/model/saga.pml` the ends and their compensations. The move to `published` made by the
//! broker's confirm is the outbox trigger (migration 0007's, as 0013 left it: one UPDATE of `jobs`
//! per relay batch), keyed on the job's `order_placed_message_id` column.
//!
//! An end decided, a job ended and an end sent again are also written into the job's story
//! ([`crate::story`]), in the same transaction as the move.
//!
//! The move that ends an order (`decide`, `rejected`) also withdraws its `order.deadline`, which
//! would otherwise be published and delivered at the deadline only to find the order ended
//! ([`deadline_message_id`]).

use chrono::{DateTime, Utc};
use messaging::{contracts::JobRetryScheduled, outbox};
use serde::{Deserialize, Serialize};
use shop::{End, OrderEnded};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::{
    order::OrderStatus,
    story::{self, Kind, Step},
};

/// The state of a job (the README's HTTP API, decision 0023).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Accepted; its `order.placed` is not yet confirmed by the broker.
    Queued,
    /// `order.placed` is out; the steps are running.
    Published,
    /// A step failed and waits in a retry tier.
    RetryWait,
    /// Invoiced (final).
    Succeeded,
    /// Refused by inventory (final).
    Rejected,
    /// A step's message was parked. An operator may redrive the message or abandon the job
    /// (`msgctl parked abandon`); the customer's cancel or the order's deadline ends it; and a
    /// result that arrives after all (a copy parked after its commit) moves it on.
    Quarantined,
    /// The order ended `declined` or `cancelled`, and inventory and billing are undoing what they
    /// did; the job then takes the order's end.
    Compensating,
    /// Refused by billing, and compensated (final).
    Declined,
    /// Cancelled by the customer, its deadline or an operator, and compensated (final).
    Cancelled,
}

impl JobState {
    /// Every state.
    pub const ALL: [Self; 9] = [
        Self::Queued,
        Self::Published,
        Self::RetryWait,
        Self::Succeeded,
        Self::Rejected,
        Self::Quarantined,
        Self::Compensating,
        Self::Declined,
        Self::Cancelled,
    ];
    /// The outcomes that never change again.
    pub const FINAL: [Self; 4] = [Self::Succeeded, Self::Rejected, Self::Declined, Self::Cancelled];
    /// The states in which the order's end is decided: no step's event moves the job any more,
    /// only the compensations' answers.
    pub const DECIDED: [Self; 5] =
        [Self::Succeeded, Self::Rejected, Self::Declined, Self::Cancelled, Self::Compensating];
    /// The states no step's retry or parking moves the job out of.
    pub const UNMOVED_BY_STEPS: [Self; 6] =
        [Self::Succeeded, Self::Rejected, Self::Declined, Self::Cancelled, Self::Compensating, Self::Quarantined];

    /// The name stored in `jobs.state` and shown by the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Published => "published",
            Self::RetryWait => "retry_wait",
            Self::Succeeded => "succeeded",
            Self::Rejected => "rejected",
            Self::Quarantined => "quarantined",
            Self::Compensating => "compensating",
            Self::Declined => "declined",
            Self::Cancelled => "cancelled",
        }
    }

    /// Whether the job has ended for good (see [`JobState::FINAL`]).
    pub fn is_final(self) -> bool {
        Self::FINAL.contains(&self)
    }
}

impl TryFrom<String> for JobState {
    type Error = String;
    fn try_from(name: String) -> Result<Self, Self::Error> {
        Self::ALL.into_iter().find(|state| state.as_str() == name).ok_or_else(|| format!("unknown job state `{name}`"))
    }
}

/// The order's status move that goes with a job's move: `order_id` takes `to` if its status is
/// one `to` may be reached from ([`OrderStatus::moves_from`]; a later one stays). It is written in
/// the job's statement (a data-modifying `WITH`), so that applying an event costs one round trip;
/// it is made whether or not the job itself moves.
#[derive(Debug, Clone, Copy)]
pub struct OrderMove {
    /// The job's order.
    pub order_id: Uuid,
    /// Its new status.
    pub to: OrderStatus,
}

/// The order of `job_id` moves to `to`, if its status is one `to` may be reached from.
pub async fn move_order_of(tx: &mut PgConnection, job_id: Uuid, to: OrderStatus) -> Result<(), sqlx::Error> {
    sqlx::query(
        "update orders set status = $1, updated_at = now()
          where id = (select order_id from jobs where id = $2) and status = any($3)",
    )
    .bind(to)
    .bind(job_id)
    .bind(to.moves_from())
    .execute(tx)
    .await
    .map(drop)
}

/// The step of `endpoint` succeeded: a queued job is published (this result proves `order.placed`
/// left, in case it overtook the relay's own mark), and a job waiting on that step's retry is not
/// waiting any more; the order moves as `order` says.
pub async fn step_succeeded(
    tx: &mut PgConnection,
    job_id: Uuid,
    endpoint: &str,
    order: OrderMove,
) -> Result<Applied, sqlx::Error> {
    // The job's row is locked before the order's, as `decide` takes them (a cancel may decide at
    // the same time): `order_moved` reads `job`, so `job` runs first.
    let known: bool = sqlx::query_scalar(
        "with job as (
            select id from jobs where id = $1 for update
         ), order_moved as (
            update orders set status = $2, updated_at = now()
             where id = $3 and status = any($4) and exists (select from job)
         ), moved as (
            update jobs set state = $5, retry_endpoint = null,
                   published_at = coalesce(published_at, now()), updated_at = now()
             where id = (select id from job) and (state = $6 or (state = $7 and retry_endpoint = $8))
         )
         select exists (select from job)",
    )
    .bind(job_id)
    .bind(order.to)
    .bind(order.order_id)
    .bind(order.to.moves_from())
    .bind(JobState::Published)
    .bind(JobState::Queued)
    .bind(JobState::RetryWait)
    .bind(endpoint)
    .fetch_one(tx)
    .await?;
    Ok(Applied::known(known, None))
}

/// A step is waiting for a retry. A late event from a step that has already succeeded (`done_step`,
/// once the order is past `accepted`) changes nothing: the job must not look older than it is.
pub async fn retry_scheduled(
    tx: &mut PgConnection,
    event: &JobRetryScheduled,
    done_step: &str,
) -> Result<Applied, sqlx::Error> {
    let known: bool = sqlx::query_scalar(
        "with moved as (
            update jobs set state = $1, retry_endpoint = $2, attempt = greatest(attempt, $3),
                   last_error = $4, updated_at = now()
             where id = $5 and state <> all($6)
               and not ($2 = $7 and exists (select 1 from orders o where o.id = jobs.order_id and o.status <> $8))
         )
         select exists (select from jobs where id = $5)",
    )
    .bind(JobState::RetryWait)
    .bind(&event.endpoint)
    .bind(i32::try_from(event.next_attempt).unwrap_or(i32::MAX))
    .bind(&event.error)
    .bind(event.job_id)
    .bind(JobState::UNMOVED_BY_STEPS)
    .bind(done_step)
    .bind(OrderStatus::Accepted)
    .fetch_one(tx)
    .await?;
    Ok(Applied::known(known, None))
}

/// Lock the job's row until the transaction ends. Events of one job are applied concurrently; a
/// quarantine and a redrive each read what the other steps' messages are doing (`job_steps`), and a
/// statement reads what had committed when it began: locking first, in a statement of its own,
/// makes the next statement see the other's steps once it has committed. Whether the job exists.
async fn lock(tx: &mut PgConnection, job_id: Uuid) -> Result<bool, sqlx::Error> {
    let locked: Option<i32> =
        sqlx::query_scalar("select 1 from jobs where id = $1 for update").bind(job_id).fetch_optional(&mut *tx).await?;
    Ok(locked.is_some())
}

/// When a job that has just ended was created, for its duration; `None` if nothing moved.
pub type Ended = Option<DateTime<Utc>>;

/// What applying a job's event found in this database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// This database has no such job. Every job is written with its order, before its
    /// `order.placed` can be published, so an event for an unknown job means a commit was lost
    /// after its message left: a failover to an asynchronous standby that had not received it.
    UnknownJob,
    /// The job is here; whether the event just ended it.
    Job(Ended),
}

impl Applied {
    fn known(known: bool, ended: Ended) -> Self {
        if known { Self::Job(ended) } else { Self::UnknownJob }
    }
}

/// A step's message was parked: the job is quarantined, unless it already ended; the attempt only
/// grows. The job keeps that the step's message is parked and `redrive_count`, how often it had
/// been redriven: a `job.redriven` of that step that is not newer is stale (see [`redriven`]),
/// whichever is applied first.
pub async fn quarantined(
    tx: &mut PgConnection,
    job_id: Uuid,
    endpoint: &str,
    attempt: u32,
    error: &str,
    redrive_count: u32,
) -> Result<Applied, sqlx::Error> {
    if !lock(tx, job_id).await? {
        return Ok(Applied::UnknownJob);
    }
    let ended = sqlx::query_scalar(
        "with step as (
            insert into job_steps (job_id, endpoint, parked, redrives) values ($1, $2, true, $3)
            on conflict (job_id, endpoint)
            do update set parked = true, redrives = greatest(job_steps.redrives, excluded.redrives)
         )
         update jobs set state = $4, attempt = greatest(attempt, $5), last_error = $6, updated_at = now()
          where id = $1 and state <> all($7)
          returning created_at",
    )
    .bind(job_id)
    .bind(endpoint)
    .bind(i32::try_from(redrive_count).unwrap_or(i32::MAX))
    .bind(JobState::Quarantined)
    .bind(i32::try_from(attempt).unwrap_or(i32::MAX))
    .bind(error)
    .bind(JobState::UNMOVED_BY_STEPS)
    .fetch_optional(tx)
    .await?;
    Ok(Applied::Job(ended))
}

/// Inventory refused the order (`inventory.rejected`, with its reason): the job and the order end
/// `rejected`, unless the order's end is decided already. Nothing was taken, so nothing is undone
/// and no `order.ended` is sent. A quarantined job takes it (its step was applied after all).
pub async fn rejected(
    tx: &mut PgConnection,
    job_id: Uuid,
    order_id: Uuid,
    reason: &str,
) -> Result<Applied, sqlx::Error> {
    let order = OrderStatus::Rejected;
    // The job's row first, then the order's (see `step_succeeded`).
    let (known, ended): (bool, Ended) = sqlx::query_as(
        "with job as (
            select id from jobs where id = $1 for update
         ), order_moved as (
            update orders set status = $2, updated_at = now()
             where id = $3 and status = any($4) and exists (select from job)
         ), moved as (
            update jobs set state = $5, last_error = coalesce($6, last_error),
                   published_at = coalesce(published_at, now()), updated_at = now()
             where id = (select id from job) and state <> all($7)
             returning created_at
         ), deadline_withdrawn as (
            -- As `decide` does.
            delete from outbox where id = (
                select id from outbox where message_id = $8 and published_at is null and exists (select from moved)
                   for update skip locked)
         )
         select exists (select from job), (select created_at from moved)",
    )
    .bind(job_id)
    .bind(order)
    .bind(order_id)
    .bind(order.moves_from())
    .bind(JobState::Rejected)
    .bind(reason)
    .bind(JobState::DECIDED)
    .bind(deadline_message_id(job_id))
    .fetch_one(&mut *tx)
    .await?;
    if ended.is_some() {
        let step = Step { detail: Some(JobState::Rejected.as_str()), ..Step::default() };
        story::record(tx, job_id, Kind::Ended, step).await?;
    }
    Ok(Applied::known(known, ended))
}

/// The message id of job `job_id`'s `order.deadline`: the job's id with the UUID version 8 (the
/// custom one), so that the move that ends the order can find the row and withdraw it without a
/// column to remember it by. Every other message id is a UUIDv7, and two jobs give two ids.
pub fn deadline_message_id(job_id: Uuid) -> Uuid {
    let mut bytes = job_id.into_bytes();
    bytes[6] = (bytes[6] & 0x0f) | 0x80;
    Uuid::from_bytes(bytes)
}

/// What deciding an order's end found ([`decide`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decided {
    /// This database has no such job (see [`Applied::UnknownJob`]).
    UnknownJob,
    /// The order had ended already, or its end was being undone: nothing changed.
    Before,
    /// The order ends now; the job's `created_at`, and its order.
    Now(DateTime<Utc>, Uuid),
}

/// Decide how the job's order ends, if it has not ended (decision 0023): one guarded update of the
/// order, which is then final, so that no later message reverses it, and with it the job:
/// `succeeded` for `Invoiced` (with its invoice, `result_key`), else `compensating` towards the
/// end, with `reason` as its last error. A decision made now is announced in the same
/// transaction: `order.ended`, through the outbox, for inventory and billing to settle or undo.
///
/// `order.ended` is sent ordered behind the order's `order.placed` (`shop::order_key`, decision
/// 0024), unless that `order.placed` will not be sent: never published, and parked in this outbox
/// (the broker refuses it), gone from it (`msgctl outbox discard`), or counted as failed at least
/// once and still being retried (the broker refused or returned it, or the relay holds it for a
/// missing queue). Then it is withdrawn (deleted: an order that has ended needs no placing), and
/// `order.ended` is sent unordered, since an ordered one would wait at inventory for a place
/// nothing may fill: the relay may park the placing later, and the job would stay `compensating`
/// (issue 56, row 7). An `order.placed` not tried yet is left to go, and the end follows it.
/// Should a failed `order.placed` arrive after all (the relay was trying it again as the order
/// ended), inventory's fence makes it take nothing.
pub async fn decide(
    tx: &mut PgConnection,
    job_id: Uuid,
    end: End,
    reason: Option<&str>,
    result_key: Option<&str>,
) -> Result<Decided, sqlx::Error> {
    let (status, state, ending) = match end {
        End::Invoiced => (OrderStatus::Invoiced, JobState::Succeeded, None),
        End::Declined => (OrderStatus::Declined, JobState::Compensating, Some(JobState::Declined)),
        End::Cancelled => (OrderStatus::Cancelled, JobState::Compensating, Some(JobState::Cancelled)),
    };
    // The job's row is locked first, then the order's, as every other move of a job takes them:
    // `decided` reads `job`, so `job` runs first.
    let (known, created_at, order_id, never_published): (bool, Option<DateTime<Utc>>, Option<Uuid>, bool) =
        sqlx::query_as(
            "with job as (
            select order_id, published_at from jobs where id = $1 for update
         ), decided as (
            update orders set status = $2, updated_at = now()
             where id = (select order_id from job) and status = any($3)
            returning id
         ), moved as (
            update jobs set state = $4, ending = $5, result_key = coalesce($6, result_key),
                   last_error = coalesce($7, last_error), retry_endpoint = null,
                   published_at = coalesce(published_at, now()), updated_at = now()
             where id = $1 and exists (select from decided)
            returning created_at, order_id
         ), deadline_withdrawn as (
            -- The order's deadline is moot once its end is decided. A relay holding the row (it is
            -- publishing it now) is not waited for: that deadline comes, and finds the order ended.
            delete from outbox where id = (
                select id from outbox where message_id = $8 and published_at is null and exists (select from moved)
                   for update skip locked)
         )
         select exists (select from job), (select created_at from moved), (select order_id from moved),
                coalesce((select published_at is null from job), false)",
        )
        .bind(job_id)
        .bind(status)
        .bind(status.moves_from())
        .bind(state)
        .bind(ending)
        .bind(result_key)
        .bind(reason)
        .bind(deadline_message_id(job_id))
        .fetch_one(&mut *tx)
        .await?;
    let decided = match (known, created_at.zip(order_id)) {
        (false, _) => Decided::UnknownJob,
        (true, None) => Decided::Before,
        (true, Some((created_at, order_id))) => Decided::Now(created_at, order_id),
    };
    if let Decided::Now(_, order_id) = decided {
        let (kind, detail) = match end {
            End::Invoiced => (Kind::Ended, Some(JobState::Succeeded.as_str())),
            End::Declined | End::Cancelled => (Kind::Compensating, reason),
        };
        story::record(tx, job_id, kind, Step { detail, ..Step::default() }).await?;
        let placed_lost = never_published && withdraw_lost_placing(tx, job_id).await?;
        let ended = OrderEnded { order_id, job_id, end, reason: reason.map(str::to_owned) };
        let ended = outbox::Outgoing::of(&ended, Some(job_id));
        let ended = if placed_lost { ended } else { ended.ordered_by(shop::order_key(order_id)) };
        ended.enqueue(tx).await?;
    }
    Ok(decided)
}

/// Whether the job's `order.placed`, never published, will not be followed: gone from this
/// outbox, parked in it, or failed at least once (then withdrawn here). See [`decide`].
///
/// A row the relay holds (it is trying it again right now) is not waited for: the relay's confirm
/// updates this job, whose row the caller holds, so waiting could deadlock. It is tried again
/// every [`WITHDRAW_EVERY`] for [`WITHDRAW_FOR`], since the relay lets go of a row it failed
/// again; a row still held after that counts as lost all the same. Its end then goes unordered
/// and the row stays: published after all, inventory's fence makes it take nothing; parked, it is
/// an outbox row parked for an order that has ended (`msgctl outbox discard` deletes it).
async fn withdraw_lost_placing(tx: &mut PgConnection, job_id: Uuid) -> Result<bool, sqlx::Error> {
    let started = std::time::Instant::now();
    loop {
        // Each statement sees the latest commits: a publish the relay confirmed meanwhile makes
        // the row published, and the end then follows it.
        let (lost, withdrawn, failed_before): (bool, bool, bool) = sqlx::query_as(
            "with placed as (
                select o.id, o.parked_at, o.attempts > 0 and o.published_at is null as failed_before
                  from jobs j left join outbox o on o.message_id = j.order_placed_message_id
                 where j.id = $1
             ), withdrawn as (
                delete from outbox where id in (
                    select id from outbox where id = (select id from placed) and published_at is null
                       and (parked_at is not null or attempts > 0)
                       for update skip locked)
                returning id
             )
             select exists (select from placed where id is null or parked_at is not null)
                    -- The relay sends the placing's `job.quarantined` before its park commits.
                    -- Broader than that (any of the job's rows the relay parked, and after a
                    -- `msgctl outbox retry` too), and safe: a placing that comes after all
                    -- finds the order fenced and takes nothing.
                    or exists (select from job_steps where job_id = $1 and endpoint like 'outbox:%' and parked),
                    exists (select from withdrawn),
                    coalesce((select failed_before from placed), false)",
        )
        .bind(job_id)
        .fetch_one(&mut *tx)
        .await?;
        if lost || withdrawn || !failed_before {
            return Ok(lost || withdrawn);
        }
        if started.elapsed() >= WITHDRAW_FOR {
            return Ok(true);
        }
        tokio::time::sleep(WITHDRAW_EVERY).await;
    }
}

/// How long [`withdraw_lost_placing`] tries to take a failed placing from a relay that holds it.
const WITHDRAW_FOR: std::time::Duration = std::time::Duration::from_millis(500);
/// How often it tries within that.
const WITHDRAW_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

/// An answer a compensating job waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Undone {
    /// `inventory.released`: the stock is back.
    Released,
    /// `invoice.voided`: no invoice stands.
    Voided,
}

/// What a compensation's answer found ([`compensated`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compensated {
    /// This database has no such job (see [`Applied::UnknownJob`]).
    UnknownJob,
    /// Stamped; the job still waits for the other answer (or was not compensating).
    Waiting,
    /// The job has just taken its end; when it was created.
    Ended(JobState, DateTime<Utc>),
}

/// A job's compensation as its row holds it.
#[derive(Debug, sqlx::FromRow)]
struct Compensation {
    state: JobState,
    ending: Option<JobState>,
    released: bool,
    voided: bool,
    created_at: DateTime<Utc>,
}

/// A compensation's answer came: it is stamped on the job, and a compensating job that now has
/// both takes its end (`declined` or `cancelled`).
pub async fn compensated(tx: &mut PgConnection, job_id: Uuid, undone: Undone) -> Result<Compensated, sqlx::Error> {
    // Both answers may be applied at once: the row is locked and read, then moved.
    let row: Option<Compensation> = sqlx::query_as(
        "select state, ending, released_at is not null as released, voided_at is not null as voided, created_at
           from jobs where id = $1 for update",
    )
    .bind(job_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(Compensation { state, ending, released, voided, created_at }) = row else {
        return Ok(Compensated::UnknownJob);
    };
    let (released, voided) = (released || undone == Undone::Released, voided || undone == Undone::Voided);
    let ends = ending.filter(|_| state == JobState::Compensating && released && voided);
    sqlx::query(
        "update jobs set state = coalesce($1, state),
                released_at = case when $2 then coalesce(released_at, now()) end,
                voided_at = case when $3 then coalesce(voided_at, now()) end,
                updated_at = now()
          where id = $4",
    )
    .bind(ends)
    .bind(released)
    .bind(voided)
    .bind(job_id)
    .execute(&mut *tx)
    .await?;
    if let Some(state) = ends {
        story::record(tx, job_id, Kind::Ended, Step { detail: Some(state.as_str()), ..Step::default() }).await?;
    }
    Ok(ends.map_or(Compensated::Waiting, |state| Compensated::Ended(state, created_at)))
}

/// The job's `order.placed`, `message_id`, will not be published after all (the relay parked it, or
/// an operator discarded it: an event of `endpoint` `outbox:…`) although its end went out ordered
/// behind it: the placing had not yet failed when [`decide`] looked (the relay was down or behind,
/// or its first failure was one it does not count: a lookup that erred, a channel that broke, an
/// overdue confirm). That end would wait at inventory for a place nothing fills until it parks, and
/// the job would stay `compensating`. So the end goes again, unordered: inventory fences the order
/// and answers, and the job ends. The ordered copy parks in time as an undo of an ended job (the
/// books find nothing wrong; `msgctl parked purge --yes --including-undos` deletes it). Nothing when
/// `endpoint` is a consumer's (its parking gives up the message's place, so an end behind it goes
/// on), when `message_id` is not the job's placing, the job is not compensating, or inventory has
/// answered already; an end that went unordered in the first place may so go twice, which every
/// consumer of `order.ended` takes.
/// Whether it went.
pub async fn placing_lost_after_end(
    tx: &mut PgConnection,
    job_id: Uuid,
    endpoint: &str,
    message_id: Uuid,
) -> Result<bool, sqlx::Error> {
    if !endpoint.starts_with("outbox:") {
        return Ok(false);
    }
    let row: Option<(Uuid, JobState, Option<String>)> = sqlx::query_as(
        "select order_id, ending, last_error from jobs
          where id = $1 and order_placed_message_id = $2 and state = $3 and released_at is null
            and ending is not null
          for update",
    )
    .bind(job_id)
    .bind(message_id)
    .bind(JobState::Compensating)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((order_id, ending, reason)) = row else { return Ok(false) };
    let end = match ending {
        JobState::Declined => End::Declined,
        JobState::Cancelled => End::Cancelled,
        other => return Err(sqlx::Error::Decode(format!("a compensating job's ending {other:?}").into())),
    };
    let ended = OrderEnded { order_id, job_id, end, reason };
    outbox::Outgoing::of(&ended, Some(job_id)).enqueue(&mut *tx).await?;
    let detail = format!("its order.placed {message_id} will not be published");
    let step = Step { endpoint: Some(endpoint), detail: Some(&detail), ..Step::default() };
    story::record(tx, job_id, Kind::EndResent, step).await?;
    Ok(true)
}

/// An operator abandoned the parked message of the job's step `endpoint` (`job.abandoned`): it is
/// no longer parked.
pub async fn step_abandoned(tx: &mut PgConnection, job_id: Uuid, endpoint: &str) -> Result<(), sqlx::Error> {
    sqlx::query("update job_steps set parked = false where job_id = $1 and endpoint = $2")
        .bind(job_id)
        .bind(endpoint)
        .execute(tx)
        .await
        .map(drop)
}

/// An operator sent the parked message of the job's step `endpoint` back (`job.redriven`, its
/// `redrive_count`-th redrive): that step's message is no longer parked, and a quarantined job is
/// in progress again unless another step's message of it still is. A redrive that is not newer
/// than what the step has seen is stale and changes nothing (the quarantine that follows a failed
/// redrive can be applied first: the two events are applied concurrently). `None` if this
/// database has no such job, else whether the job moved.
pub async fn redriven(
    tx: &mut PgConnection,
    job_id: Uuid,
    endpoint: &str,
    redrive_count: u32,
) -> Result<Option<bool>, sqlx::Error> {
    if !lock(tx, job_id).await? {
        return Ok(None);
    }
    // The statement sees `job_steps` as it was before `step` wrote: hence `endpoint <> $2`.
    let moved = sqlx::query(
        "with step as (
            insert into job_steps (job_id, endpoint, parked, redrives) values ($1, $2, false, $3)
            on conflict (job_id, endpoint)
            do update set parked = false, redrives = excluded.redrives
             where job_steps.redrives < excluded.redrives
            returning 1
         )
         update jobs set state = $4, retry_endpoint = null, updated_at = now()
          where id = $1 and state = $5 and exists (select from step)
            and not exists (select from job_steps where job_id = $1 and endpoint <> $2 and parked)",
    )
    .bind(job_id)
    .bind(endpoint)
    .bind(i32::try_from(redrive_count).unwrap_or(i32::MAX))
    .bind(JobState::Published)
    .bind(JobState::Quarantined)
    .execute(tx)
    .await?
    .rows_affected();
    Ok(Some(moved == 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_s_id_is_its_job_s_in_version_8() {
        let job = Uuid::now_v7();
        let deadline = deadline_message_id(job);
        assert_eq!(deadline.get_version_num(), 8);
        assert_ne!(deadline, job);
        assert_eq!(deadline.as_bytes()[6] & 0x0f, job.as_bytes()[6] & 0x0f);
        assert_eq!(deadline.as_bytes()[7..], job.as_bytes()[7..]);
        assert_eq!(deadline.as_bytes()[..6], job.as_bytes()[..6]);
        assert_eq!(deadline_message_id(job), deadline, "the same job, the same id");
    }

    #[test]
    fn states_round_trip_through_their_names_and_the_api() {
        for state in JobState::ALL {
            assert_eq!(JobState::try_from(state.as_str().to_owned()), Ok(state));
            assert_eq!(serde_json::to_value(state).expect("json"), state.as_str());
        }
        assert!(JobState::try_from("done".to_owned()).is_err());
        assert_eq!(JobState::ALL.into_iter().filter(|state| state.is_final()).count(), 4);
        for state in JobState::FINAL {
            assert!(JobState::DECIDED.contains(&state) && JobState::UNMOVED_BY_STEPS.contains(&state), "{state:?}");
        }
    }
}
