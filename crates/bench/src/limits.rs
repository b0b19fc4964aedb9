//! What Postgres and RabbitMQ on this machine can do with our exact work and no service code
//! around it: the bounds each stage is measured against.

use std::{
    collections::VecDeque,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Instant,
};

use futures_util::StreamExt;
use lapin::{
    Connection,
    options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use messaging::{
    contracts::Contract, envelope::Incoming, handler::Handler, inbox, outbox, outbox_relay, publisher::Publisher,
};
use orders_api::{
    api::{OrderLineRequest, PlaceOrder},
    group_commit::insert_orders,
    order::{Accepted, ValidOrder},
    place::NewOrder,
};
use shop::{InventoryReserved, InvoiceCreated, OrderPlaced};
use sqlx::{PgPool, postgres::PgPoolOptions};
use uuid::Uuid;

use crate::stages::{Usage, Used};

/// Which SKUs the orders of a load draw from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Catalog {
    /// The four everyday SKUs: every order locks two of the same four stock rows.
    Hot,
    /// `WIDE-0000` onwards, this many: two orders rarely share a stock row, so what is left is
    /// the CPU cost, not the lock waits.
    Wide(usize),
}

impl Catalog {
    /// The SKUs of [`Catalog::Wide`] (they are created with ample stock before the load).
    pub fn wide_skus(count: usize) -> Vec<String> {
        (0..count).map(|n| format!("WIDE-{n:04}")).collect()
    }
}

/// The order every load uses: two lines of `catalog`'s SKUs.
pub fn sample_order(i: usize, catalog: Catalog) -> PlaceOrder {
    let sku = |n: usize| match catalog {
        Catalog::Hot => format!("SKU-{}", n % 4 + 1),
        Catalog::Wide(count) => format!("WIDE-{:04}", n.wrapping_mul(7919) % count),
    };
    let line = |n: usize| OrderLineRequest { sku: sku(n), quantity: 1 };
    PlaceOrder { customer_id: "bench".into(), lines: vec![line(i), line(i + 1)] }
}

/// [`sample_order`] of the hot catalog, parsed as the API parses it.
fn valid_order(i: usize) -> ValidOrder {
    sample_order(i, Catalog::Hot).parse().expect("the sample order is valid")
}

/// Run `count` jobs on `concurrency` tasks; returns jobs per second.
async fn run_concurrently<F, Fut>(concurrency: usize, count: usize, job: F) -> f64
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let job = Arc::new(job);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (job, next) = (Arc::clone(&job), Arc::clone(&next));
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                job(i).await;
            }
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.expect("load task");
    }
    count as f64 / started.elapsed().as_secs_f64()
}

/// A pool of `size` connections on `url`.
pub async fn pool(url: &str, size: u32) -> PgPool {
    PgPoolOptions::new().max_connections(size).connect(url).await.expect("connect")
}

/// (a) The API's order statement (order, lines, job, outbox row, all or nothing), by a plain loop.
pub async fn order_transaction(url: &str, concurrency: usize, count: usize) -> f64 {
    let pool = pool(url, concurrency as u32).await;
    run_concurrently(concurrency, count, move |i| {
        let pool = pool.clone();
        async move {
            let mut conn = pool.acquire().await.expect("connection");
            let ids = Accepted { job_id: Uuid::now_v7(), order_id: Uuid::now_v7() };
            let order = NewOrder::new(ids, &valid_order(i), None, deadline());
            insert_orders(&mut conn, &[&order]).await.expect("insert order");
        }
    })
    .await
}

/// (a') The smallest transaction that does the API's job: one order row with its lines as JSON,
/// and its `order.placed` outbox row (BEGIN, two INSERTs, COMMIT), by a plain loop. `pool` is a
/// database of its own with messaging's tables, so that its rows meet no later stage.
pub async fn smallest_order_transaction(pool: &PgPool, concurrency: usize, count: usize) -> f64 {
    sqlx::query(
        "create table if not exists smallest_orders (id uuid primary key, customer_id text not null, lines jsonb not null)",
    )
    .execute(pool)
    .await
    .expect("create smallest_orders");
    let pool = pool.clone();
    run_concurrently(concurrency, count, move |i| {
        let pool = pool.clone();
        async move {
            let placed =
                valid_order(i).placed(&Accepted { job_id: Uuid::now_v7(), order_id: Uuid::now_v7() }, deadline());
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query("insert into smallest_orders (id, customer_id, lines) values ($1, $2, $3)")
                .bind(placed.order_id)
                .bind(&placed.customer_id)
                .bind(sqlx::types::Json(&placed.lines))
                .execute(&mut *tx)
                .await
                .expect("insert order");
            outbox::enqueue(&mut tx, &placed, Some(placed.job_id)).await.expect("insert outbox row");
            tx.commit().await.expect("commit");
        }
    })
    .await
}

/// The first `count` outbox rows, exactly as the relay would read them.
pub async fn outbox_rows(pool: &PgPool, count: usize) -> Vec<outbox_relay::OutboxRow> {
    let mut tx = pool.begin().await.expect("begin");
    let rows = outbox_relay::claim_unpublished(&mut tx, count as i64).await.expect("read outbox");
    tx.rollback().await.expect("rollback");
    rows
}

/// (b) Publish `rows` with confirms, `window` outstanding at most; returns messages per second.
pub async fn publish(connection: &Connection, rows: &[outbox_relay::OutboxRow], window: usize) -> f64 {
    let publisher = Publisher::open(connection).await.expect("publisher");
    let started = Instant::now();
    let mut pending = VecDeque::with_capacity(window);
    for row in rows {
        if pending.len() >= window {
            let oldest: messaging::publisher::Pending = pending.pop_front().expect("pending");
            oldest.confirmed().await.expect("confirmed");
        }
        let sent = publisher.send(&row.exchange, &row.routing_key, row.payload.as_bytes(), row.properties()).await;
        pending.push_back(sent.expect("publish"));
    }
    for sent in pending {
        sent.confirmed().await.expect("confirmed");
    }
    let rate = rows.len() as f64 / started.elapsed().as_secs_f64();
    publisher.close().await;
    rate
}

/// The relay's database work on `rows` (unpublished, and left so), each part alone, in batches of
/// `batch` as the relay takes them: the claim (`claim_unpublished` in a transaction, rolled back)
/// and the mark (`mark_published` and its commit, undone afterwards, untimed). What each used:
/// the bench's process, Postgres and RabbitMQ, as the relay's own figure counts them. `pool`
/// should be opened as the relay opens its sessions (`relay::session_options`), or the claim may
/// be planned differently from the relay's.
pub async fn claim_and_mark(pool: &PgPool, rows: &[outbox_relay::OutboxRow], batch: usize) -> (Used, Used) {
    let window = Usage::of_bench();
    for chunk in rows.chunks(batch) {
        let mut tx = pool.begin().await.expect("begin");
        let claimed = outbox_relay::claim_unpublished(&mut tx, chunk.len() as i64).await.expect("claim");
        assert_eq!(claimed.len(), chunk.len(), "the outbox holds the rows to claim");
        tx.rollback().await.expect("rollback");
    }
    let claim = window.finish();
    let ids: Vec<i64> = rows.iter().map(|row| row.id).collect();
    let window = Usage::of_bench();
    for chunk in ids.chunks(batch) {
        let mut tx = pool.begin().await.expect("begin");
        outbox_relay::mark_published(&mut tx, chunk).await.expect("mark");
        tx.commit().await.expect("commit");
    }
    let mark = window.finish();
    sqlx::query("update outbox set published_at = null where id = any($1)")
        .bind(&ids)
        .execute(pool)
        .await
        .expect("unmark");
    (claim, mark)
}

/// (c) Consume and ack `count` messages from `queue` with `prefetch`; messages per second.
pub async fn consume(connection: &Connection, queue: &str, count: usize, prefetch: u16) -> f64 {
    let channel = connection.create_channel().await.expect("channel");
    channel.basic_qos(prefetch, BasicQosOptions::default()).await.expect("qos");
    let mut deliveries = channel
        .basic_consume(queue.into(), "bench".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .expect("consume");
    let started = Instant::now();
    for _ in 0..count {
        let delivery = deliveries.next().await.expect("delivery").expect("delivery");
        delivery.ack(BasicAckOptions::default()).await.expect("ack");
    }
    let rate = count as f64 / started.elapsed().as_secs_f64();
    let _ = channel.close(200, "bye".into()).await;
    rate
}

/// As a consumer receives a message of contract `C`: its type, version and job.
fn incoming<C: Contract>(message: &C) -> Incoming {
    Incoming {
        message_id: Uuid::now_v7(),
        message_type: C::TYPE.into(),
        version: C::VERSION,
        correlation_id: message.job(),
        retry_count: 0,
        ordering: None,
        body: serde_json::to_vec(message).expect("a contract serializes"),
    }
}

/// `order.placed` of `count` fresh orders of the hot catalog: what inventory receives.
pub fn orders_placed(count: usize) -> Vec<Incoming> {
    (0..count)
        .map(|i| {
            incoming(&valid_order(i).placed(&Accepted { job_id: Uuid::now_v7(), order_id: Uuid::now_v7() }, deadline()))
        })
        .collect()
}

/// The `inventory.reserved` inventory announces for `placed`.
fn reserved(placed: &OrderPlaced) -> Incoming {
    incoming(&InventoryReserved {
        order_id: placed.order_id,
        job_id: placed.job_id,
        reservation_id: Uuid::now_v7(),
        lines: placed.lines.clone(),
        deadline: placed.deadline,
    })
}

/// `inventory.reserved` of `count` fresh orders of the hot catalog: what billing receives.
pub fn inventory_reserved(count: usize) -> Vec<Incoming> {
    (0..count)
        .map(|i| {
            reserved(&valid_order(i).placed(&Accepted { job_id: Uuid::now_v7(), order_id: Uuid::now_v7() }, deadline()))
        })
        .collect()
}

/// What the status consumer receives for `count` orders that succeed: each order's
/// `inventory.reserved`, then each order's `invoice.created`. The orders and their jobs are
/// accepted first, in `pool` (the orders service's tables), as the API accepts them.
pub async fn order_outcomes(pool: &PgPool, count: usize) -> Vec<Incoming> {
    let orders: Vec<NewOrder> = (0..count)
        .map(|i| {
            NewOrder::new(
                Accepted { job_id: Uuid::now_v7(), order_id: Uuid::now_v7() },
                &valid_order(i),
                None,
                deadline(),
            )
        })
        .collect();
    let mut conn = pool.acquire().await.expect("connection");
    for chunk in orders.chunks(500) {
        insert_orders(&mut conn, &chunk.iter().collect::<Vec<_>>()).await.expect("accept the orders");
    }
    let reserved = orders.iter().map(|order| reserved(&order.placed));
    let invoiced = orders.iter().map(|order| {
        let placed = &order.placed;
        let total_cents = 100 * placed.lines.iter().map(|line| i64::from(line.quantity)).sum::<i64>();
        incoming(&InvoiceCreated {
            order_id: placed.order_id,
            job_id: placed.job_id,
            invoice_id: Uuid::now_v7(),
            total_cents,
        })
    });
    reserved.chain(invoiced).collect()
}

/// (d), (e), (f) A consumer's work on `messages`, by a plain loop: the inbox rows and the
/// service's own `handler` in one transaction, exactly as the consumer runtime applies them, in
/// the consumer's shape: `batch` messages per transaction, one transaction at a time, or
/// (`batch` 1) one message per transaction, `prefetch` at once. `pool` has the service's tables
/// and at least that many connections. Messages per second, and what it used: the bench's process
/// (building the messages is not timed), Postgres and RabbitMQ.
pub async fn consumer_transactions<H: Handler>(
    pool: &PgPool,
    endpoint: &'static str,
    handler: H,
    messages: Vec<Incoming>,
    prefetch: usize,
    batch: usize,
) -> (f64, Used) {
    let concurrency = if batch > 1 { 1 } else { prefetch };
    let count = messages.len();
    let mut messages = messages.into_iter();
    let transactions: Arc<Vec<Vec<Incoming>>> =
        Arc::new((0..count.div_ceil(batch)).map(|_| messages.by_ref().take(batch).collect()).collect());
    let (pool, handler, total) = (pool.clone(), Arc::new(handler), transactions.len());
    let window = Usage::of_bench();
    let rate = run_concurrently(concurrency, total, move |t| {
        let (pool, handler, transactions) = (pool.clone(), Arc::clone(&handler), Arc::clone(&transactions));
        async move {
            let messages = &transactions[t];
            // As the consumer runtime does: one message alone, or a batch's inbox rows in one
            // statement.
            let mut tx = pool.begin().await.expect("begin");
            let ids: Vec<(Uuid, &str)> = messages.iter().map(|m| (m.message_id, m.message_type.as_str())).collect();
            let recorded = if messages.len() > 1 {
                inbox::record_all(&mut tx, &ids, endpoint).await.expect("inbox")
            } else {
                vec![inbox::record(&mut tx, ids[0].0, ids[0].1, endpoint).await.expect("inbox")]
            };
            assert!(recorded.iter().all(|new| *new), "fresh message ids");
            for message in messages {
                handler.handle(message, &mut tx).await.expect("the handler applies a fresh message");
            }
            tx.commit().await.expect("commit");
        }
    })
    .await;
    let used = window.finish();
    (rate * count as f64 / total as f64, used)
}

/// An order's deadline at the default `ORDER_DEADLINE` (30 min): never reached in a bench.
fn deadline() -> chrono::DateTime<chrono::Utc> {
    chrono::Utc::now() + chrono::TimeDelta::minutes(30)
}
