//! An accepted order, written: the order and its lines, its job, its `order.placed` outbox row, its
//! `order.deadline` row scheduled for the order's deadline, and any idempotency claim, all in one
//! transaction ([`write()`]), so that the order and its messages commit together or not at all.
//! This is the path a newcomer reads and the default one. Group commit ([`crate::group_commit`],
//! `ORDER_GROUP_COMMIT`) writes the same rows for the orders that arrive together in one statement;
//! [`Writer`] is either.

use chrono::{DateTime, Utc};
use messaging::{
    envelope::Headers,
    outage, outbox,
    runtime::{db, failpoint},
};
use shop::{OrderDeadline, OrderPlaced};
use sqlx::{PgPool, types::Json};
use uuid::Uuid;

use crate::{
    group_commit,
    order::{Accepted, IdempotencyKey, ValidOrder},
};

/// Failpoint (`messaging::runtime::failpoint`): an order's rows are written and not yet committed
/// (with group commit: a writer holds a connection for a batch and has not yet sent its one
/// statement).
pub const BEFORE_COMMIT: &str = "api.before-commit";

/// An idempotency key, and the request it came with: a later request with the key gets the same
/// job if it brings the same request, and a 422 if not.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The key.
    pub key: IdempotencyKey,
    /// The request as parsed (`jsonb` equality ignores key order and whitespace).
    pub request: serde_json::Value,
}

/// One accepted order, ready to be written.
#[derive(Debug)]
pub struct NewOrder {
    /// The ids the client will be given.
    pub ids: Accepted,
    /// Its `order.placed` body (it also holds the customer and the lines).
    pub placed: OrderPlaced,
    /// Its idempotency claim, if a key came with it.
    pub claim: Option<Claim>,
    /// The outbox row's id.
    pub message_id: Uuid,
    /// The outbox row's headers: the job as correlation id, the trace context current when the
    /// order was made (the request's span), and the order's ordering key ([`shop::order_key`]).
    pub headers: Headers,
    /// Its `order.deadline`, scheduled for `deadline`: a second outbox row, delivered to the
    /// orders service itself then.
    pub deadline: ScheduledDeadline,
}

/// An order's `order.deadline` outbox row, due at the order's deadline.
#[derive(Debug)]
pub struct ScheduledDeadline {
    /// The body.
    pub body: OrderDeadline,
    /// When it is due.
    pub at: DateTime<Utc>,
    /// The row's id, made from the job's ([`crate::jobs::deadline_message_id`]): the move that
    /// ends the order withdraws the row.
    pub message_id: Uuid,
    /// The row's headers (as [`NewOrder::headers`]).
    pub headers: Headers,
}

impl ScheduledDeadline {
    /// Job `job_id`'s `order.deadline` for `order_id`, due `at`, under the id the move that ends
    /// the order withdraws it by.
    pub fn new(order_id: Uuid, job_id: Uuid, at: DateTime<Utc>) -> Self {
        let message_id = crate::jobs::deadline_message_id(job_id);
        let headers = Headers::of::<OrderDeadline>(Some(job_id));
        Self { body: OrderDeadline { order_id, job_id }, at, message_id, headers }
    }

    /// Its outbox row, due at `at`.
    pub fn row(&self) -> outbox::Outgoing<'_, OrderDeadline> {
        outbox::Outgoing::identified(&self.body, self.message_id, self.headers.clone()).at(self.at)
    }
}

impl NewOrder {
    /// `order` under `ids`, to be cancelled at `deadline` if it has not ended, with the current
    /// trace context.
    pub fn new(ids: Accepted, order: &ValidOrder, claim: Option<Claim>, deadline: DateTime<Utc>) -> Self {
        let placed = order.placed(&ids, deadline);
        // The job names its order.placed row, so that the row's confirm marks it `published`.
        let message_id = Uuid::now_v7();
        let headers = Headers::of::<OrderPlaced>(Some(ids.job_id)).ordered_by(shop::order_key(ids.order_id));
        let deadline = ScheduledDeadline::new(ids.order_id, ids.job_id, deadline);
        Self { ids, placed, claim, message_id, headers, deadline }
    }

    /// Its `order.placed` outbox row.
    fn placed_row(&self) -> outbox::Outgoing<'_, OrderPlaced> {
        outbox::Outgoing::identified(&self.placed, self.message_id, self.headers.clone())
    }
}

/// Write `order` in one transaction of its own: the order, its lines, its job (`queued`, named by
/// its `order.placed` row, with the trace it belongs to), its idempotency claim (after the rows it
/// names; a concurrent request with the same key waits on it until this commits, then finds it
/// taken) and its two outbox rows. `false`: its key was claimed already, and nothing was written.
pub async fn write(pool: &PgPool, order: &NewOrder) -> Result<bool, sqlx::Error> {
    let (ids, placed) = (&order.ids, &order.placed);
    // The request's deadline may give this up at any await (`db::within` in the route): the
    // connection is then closed, not handed back inside an unanswered `BEGIN` or a statement that
    // a silent server never answers (decision 0029). It goes back once the transaction has ended.
    let mut conn = db::Taken::acquire(pool).await?;
    conn.close_on_drop();
    let mut tx = conn.begin().await?;
    sqlx::query("insert into orders (id, customer_id) values ($1, $2)")
        .bind(ids.order_id)
        .bind(&placed.customer_id)
        .execute(&mut *tx)
        .await?;
    let (skus, quantities): (Vec<&str>, Vec<i32>) =
        placed.lines.iter().map(|line| (line.sku.as_str(), line.quantity)).unzip();
    sqlx::query(
        "insert into order_lines (order_id, line_no, sku, quantity)
         select $1, line_no::int, sku, quantity
           from unnest($2::text[], $3::int[]) with ordinality as line (sku, quantity, line_no)",
    )
    .bind(ids.order_id)
    .bind(skus)
    .bind(quantities)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "insert into jobs (id, order_id, order_placed_message_id, trace_id)
         values ($1, $2, $3, nullif(split_part($4::jsonb ->> 'traceparent', '-', 2), ''))",
    )
    .bind(ids.job_id)
    .bind(ids.order_id)
    .bind(order.message_id)
    .bind(Json(&order.headers))
    .execute(&mut *tx)
    .await?;
    if let Some(Claim { key, request }) = &order.claim {
        let claimed: Option<Uuid> = sqlx::query_scalar(
            "insert into idempotency_keys (key, request, job_id, order_id) values ($1, $2, $3, $4)
             on conflict (key) do nothing
             returning job_id",
        )
        .bind(key.as_str())
        .bind(request)
        .bind(ids.job_id)
        .bind(ids.order_id)
        .fetch_optional(&mut *tx)
        .await?;
        if claimed.is_none() {
            // Nothing of this order is written.
            tx.rollback().await?;
            conn.return_on_drop();
            return Ok(false);
        }
    }
    order.placed_row().enqueue(&mut tx).await?;
    order.deadline.row().enqueue(&mut tx).await?;
    failpoint::hit(BEFORE_COMMIT).await;
    tx.commit().await?;
    conn.return_on_drop();
    Ok(true)
}

/// Why an order was not written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Its statement failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// With group commit: the statement of the batch it was in failed for all of them, as `error`
    /// says (the database is unreachable, or it was the only order).
    #[error("{error} (in a batch of orders)")]
    Batch {
        /// The failure, as the batch's first order got it.
        error: String,
        /// Whether the database was unreachable.
        unreachable: bool,
    },
    /// With group commit: the writers have stopped (the service is shutting down).
    #[error("the order writers have stopped")]
    Stopped,
}

impl WriteError {
    /// Whether the client should retry later (a 503): the database did not answer, the statement
    /// lost to other work ([`outage::lost_to_other_work`]), or the service is stopping.
    pub fn retry_later(&self) -> bool {
        match self {
            Self::Database(error) => outage::retry_later(error),
            Self::Batch { unreachable, .. } => *unreachable,
            Self::Stopped => true,
        }
    }
}

/// How accepted orders are written (`ORDER_GROUP_COMMIT`): each in a transaction of its own
/// ([`write()`], the default), or the orders that arrive together in one statement
/// ([`group_commit`]).
#[derive(Debug, Clone)]
pub enum Writer {
    /// [`write()`], on this pool.
    Alone(PgPool),
    /// [`group_commit::Writers`].
    Grouped(group_commit::Writers),
}

impl Writer {
    /// Write `order`. `false`: its idempotency key was already claimed, and nothing was written.
    pub async fn write(&self, order: NewOrder) -> Result<bool, WriteError> {
        match self {
            // Boxed: its statements' state would otherwise sit in every request's future.
            Self::Alone(pool) => Ok(Box::pin(write(pool, &order)).await?),
            Self::Grouped(writers) => writers.write(order).await,
        }
    }
}
