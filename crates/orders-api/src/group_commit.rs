//! Group commit for `POST /orders`, opt-in (`ORDER_GROUP_COMMIT`, decision 0009): the orders that
//! arrive while the writers are busy are written together, in one statement and so one round trip
//! and one commit ([`insert_orders`]), where [`crate::place::write`] takes a transaction of seven
//! round trips (eight with an idempotency key) for each. The rows are the same; `just bench`
//! prints both accept rates.
//!
//! A request hands its order to a queue and waits for the answer. Each of a few writer tasks
//! takes what the queue holds (at least one order, at most [`MAX_ORDERS`]), writes it and
//! answers every request. When a writer is idle, a request is taken at once, alone: batches form
//! only under load, so they add no latency when there is none.
//!
//! Every order's outcome is its own, as if it had been written alone:
//! - A taken idempotency key writes nothing of that order and nothing else changes; two requests
//!   with one key in the same batch: the first claims it, the second finds it taken.
//! - If the batch's statement fails, nothing of it was written (one statement, all or nothing),
//!   and its orders are written again one by one, so that one order's failure is that order's
//!   alone. An unreachable database fails them all at once instead (503), without a retry each.
//! - A request that gave up (its deadline passed) before its batch was taken is not written.
//!   One that gives up after may still be written, as when a request's own statement outlives
//!   its deadline: the client retries with its `Idempotency-Key`.

use std::sync::Arc;

use messaging::{
    outage, outbox,
    runtime::{
        db::{self, QUERY_DEADLINE},
        failpoint,
        metrics::Metrics,
    },
};
use prometheus_client::metrics::{counter::Counter, family::Family};
use shop::{OrderDeadline, OrderPlaced};
use sqlx::{PgConnection, PgPool, QueryBuilder, types::Json};
use tokio::sync::{Mutex, mpsc, oneshot};
use uuid::Uuid;

use crate::place::{BEFORE_COMMIT, NewOrder, WriteError};

/// Statements that wrote several orders, by `outcome`: `committed`, or `fell_back` (the statement
/// failed, and its orders were written again one by one).
pub const ORDER_BATCHES: &str = "order_batches_total";
/// Most orders in one statement.
pub const MAX_ORDERS: usize = 64;
/// Orders waiting for a writer, at most; a request beyond it waits for room.
const QUEUE: usize = 1024;

/// Everything the accepted `orders` write, in one statement and so one round trip, all or
/// nothing: for each, the idempotency claim (if a key is given: claimed first, in key order, so
/// that a concurrent request with the same key waits on it until this commits, then finds it
/// taken), the order, its lines, its job, its `order.placed` outbox row and its `order.deadline`
/// row, scheduled ([`outbox::Outgoing::at`]). Returns the jobs of
/// the orders written; an order whose key was already claimed is not among them, and nothing of
/// it was written.
pub async fn insert_orders(conn: &mut PgConnection, orders: &[&NewOrder]) -> Result<Vec<Uuid>, sqlx::Error> {
    let mut lines = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for order in orders {
        for (line_no, line) in (1..).zip(&order.placed.lines) {
            lines.0.push(order.ids.order_id);
            lines.1.push(line_no);
            lines.2.push(line.sku.as_str());
            lines.3.push(line.quantity);
        }
    }
    // Every write selects from `go`: the orders without a key, and those whose claim was inserted
    // (`returning job_id` names the claimant, also when two orders of the batch bring the same
    // key). Each array is bound where it is used, numbered by the builder. (The bodies are the
    // shop's own structs, which serialize without fail: the builder panics on a value it cannot
    // encode.)
    let mut statement = QueryBuilder::new("with input as (select * from unnest(");
    let mut arrays = statement.separated(", ");
    arrays.push_bind(orders.iter().map(|o| o.ids.order_id).collect::<Vec<_>>()).push_unseparated("::uuid[]");
    arrays.push_bind(orders.iter().map(|o| o.ids.job_id).collect::<Vec<_>>()).push_unseparated("::uuid[]");
    arrays
        .push_bind(orders.iter().map(|o| o.placed.customer_id.as_str()).collect::<Vec<_>>())
        .push_unseparated("::text[]");
    let keys = orders.iter().map(|o| o.claim.as_ref().map(|claim| claim.key.as_str()));
    arrays.push_bind(keys.collect::<Vec<_>>()).push_unseparated("::text[]");
    let requests = orders.iter().map(|o| o.claim.as_ref().map(|claim| &claim.request));
    arrays.push_bind(requests.collect::<Vec<_>>()).push_unseparated("::jsonb[]");
    arrays.push_bind(orders.iter().map(|o| o.message_id).collect::<Vec<_>>()).push_unseparated("::uuid[]");
    arrays.push_bind(orders.iter().map(|o| Json(&o.placed)).collect::<Vec<_>>()).push_unseparated("::jsonb[]");
    arrays.push_bind(orders.iter().map(|o| Json(&o.headers)).collect::<Vec<_>>()).push_unseparated("::jsonb[]");
    arrays.push_bind(orders.iter().map(|o| o.deadline.message_id).collect::<Vec<_>>()).push_unseparated("::uuid[]");
    arrays.push_bind(orders.iter().map(|o| Json(&o.deadline.body)).collect::<Vec<_>>()).push_unseparated("::jsonb[]");
    let deadline_headers = orders.iter().map(|o| Json(&o.deadline.headers));
    arrays.push_bind(deadline_headers.collect::<Vec<_>>()).push_unseparated("::jsonb[]");
    arrays.push_bind(orders.iter().map(|o| o.deadline.at).collect::<Vec<_>>()).push_unseparated("::timestamptz[]");
    statement.push(
        ") with ordinality as input (order_id, job_id, customer_id, key, request, message_id, payload, headers,
                                     deadline_id, deadline_payload, deadline_headers, deadline_at, n)
         ), claim as (
             insert into idempotency_keys (key, request, job_id, order_id)
             select key, request, job_id, order_id from input where key is not null order by key
             on conflict (key) do nothing
             returning job_id
         ), go as (
             select * from input where key is null or job_id in (select job_id from claim)
         ), new_orders as (
             insert into orders (id, customer_id) select order_id, customer_id from go
         ), new_lines as (
             insert into order_lines (order_id, line_no, sku, quantity)
             select line.* from unnest(",
    );
    let mut arrays = statement.separated(", ");
    arrays.push_bind(lines.0).push_unseparated("::uuid[]");
    arrays.push_bind(lines.1).push_unseparated("::int[]");
    arrays.push_bind(lines.2).push_unseparated("::text[]");
    arrays.push_bind(lines.3).push_unseparated("::int[]");
    statement.push(
        ") as line (order_id, line_no, sku, quantity)
             where line.order_id in (select order_id from go)
         ), new_jobs as (
             insert into jobs (id, order_id, order_placed_message_id, trace_id)
             select job_id, order_id, message_id, nullif(split_part(headers ->> 'traceparent', '-', 2), '') from go
         ), new_messages as (
             ",
    );
    let placed =
        outbox::Selected { message_id: "message_id", payload: "payload", headers: "headers", deliver_at: None };
    placed.push_insert::<OrderPlaced>(&mut statement, "go order by n");
    statement.push(
        "
         ), new_deadlines as (
             ",
    );
    let deadlines = outbox::Selected {
        message_id: "deadline_id",
        payload: "deadline_payload",
        headers: "deadline_headers",
        deliver_at: Some("deadline_at"),
    };
    deadlines.push_insert::<OrderDeadline>(&mut statement, "go order by n");
    statement.push(
        "
         )
         select job_id from go",
    );
    statement.build_query_scalar().fetch_all(conn).await
}

/// An order on its way to a writer, and where its outcome goes.
struct Pending {
    order: NewOrder,
    reply: oneshot::Sender<Result<bool, WriteError>>,
}

/// The queue to the writer tasks. Cloning it is cheap; the writers stop once every clone is
/// dropped and the queue is empty.
#[derive(Debug, Clone)]
pub struct Writers {
    queue: mpsc::Sender<Pending>,
}

impl Writers {
    /// Start `writers` writer tasks on `pool` (each holds one connection while it writes).
    pub fn start(pool: PgPool, writers: usize, metrics: BatchMetrics) -> Self {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..writers.max(1) {
            tokio::spawn(write_batches(pool.clone(), Arc::clone(&receiver), metrics.clone()));
        }
        Self { queue }
    }

    /// Write `order`, with whatever else is waiting. `false`: its idempotency key was already
    /// claimed, and nothing was written.
    pub async fn write(&self, order: NewOrder) -> Result<bool, WriteError> {
        let (reply, outcome) = oneshot::channel();
        self.queue.send(Pending { order, reply }).await.map_err(|_| WriteError::Stopped)?;
        outcome.await.map_err(|_| WriteError::Stopped)?
    }
}

/// How the writers' statements of several orders went, counted in [`ORDER_BATCHES`].
#[derive(Debug, Clone)]
pub struct BatchMetrics {
    committed: Counter,
    fell_back: Counter,
}

impl BatchMetrics {
    /// Register [`ORDER_BATCHES`] beside the runtime's metrics.
    pub fn register(metrics: &mut Metrics) -> Self {
        let batches = Family::<[(&str, &str); 1], Counter>::default();
        metrics.register(
            "order_batches",
            "Statements writing several orders: committed, or fell back to writing each alone",
            batches.clone(),
        );
        let outcome = |outcome| batches.get_or_create(&[("outcome", outcome)]).clone();
        Self { committed: outcome("committed"), fell_back: outcome("fell_back") }
    }
}

/// One writer: take what is queued (waiting for at least one order), write it, answer; until the
/// queue is closed.
async fn write_batches(pool: PgPool, receiver: Arc<Mutex<mpsc::Receiver<Pending>>>, metrics: BatchMetrics) {
    let mut batch = Vec::with_capacity(MAX_ORDERS);
    loop {
        if receiver.lock().await.recv_many(&mut batch, MAX_ORDERS).await == 0 {
            return;
        }
        // Its request is gone (the deadline passed): not written.
        batch.retain(|pending| !pending.reply.is_closed());
        if !batch.is_empty() {
            write_batch(&pool, &mut batch, &metrics).await;
        }
    }
}

/// Write `batch` in one statement, or, if that fails, each order alone; answer every request.
/// Each step runs within [`QUERY_DEADLINE`]: a writer on a silent (black-holed) connection drops
/// it and moves on, as a request's own statement would.
async fn write_batch(pool: &PgPool, batch: &mut Vec<Pending>, metrics: &BatchMetrics) {
    let orders: Vec<&NewOrder> = batch.iter().map(|pending| &pending.order).collect();
    let outcomes = async {
        let mut conn = db::within(QUERY_DEADLINE, db::acquire(pool)).await?;
        failpoint::hit(BEFORE_COMMIT).await;
        let error = match db::within(QUERY_DEADLINE, insert_orders(&mut conn, &orders)).await {
            Ok(written) => {
                if orders.len() > 1 {
                    metrics.committed.inc();
                }
                return Ok(orders.iter().map(|order| Ok(written.contains(&order.ids.job_id))).collect());
            }
            Err(error) if orders.len() == 1 || outage::is_unreachable(&error) => return Err(error),
            Err(error) => error,
        };
        // Nothing of the batch was written: each order again, alone, on the same connection.
        metrics.fell_back.inc();
        tracing::info!(orders = orders.len(), %error, "a batch of orders failed; writing each alone");
        let mut outcomes = Vec::with_capacity(orders.len());
        for order in &orders {
            let written = db::within(QUERY_DEADLINE, insert_orders(&mut conn, &[order])).await;
            outcomes.push(written.map(|written| !written.is_empty()).map_err(WriteError::from));
        }
        Ok(outcomes)
    };
    let outcomes: Vec<Result<bool, WriteError>> = match outcomes.await {
        Ok(outcomes) => outcomes,
        // One request gets the error as it is, the others what it was: still an unreachable
        // database's (a 503) or, for a lone order, its own.
        Err(error) => {
            let (description, unreachable) = (error.to_string(), outage::is_unreachable(&error));
            std::iter::once(Err(WriteError::Database(error)))
                .chain(std::iter::repeat_with(|| Err(WriteError::Batch { error: description.clone(), unreachable })))
                .take(batch.len())
                .collect()
        }
    };
    for (pending, outcome) in batch.drain(..).zip(outcomes) {
        let _ = pending.reply.send(outcome);
    }
}
