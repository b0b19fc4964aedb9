//! Two transactions that move the same jobs take them in one order, job id: two status batches
//! (two instances of the API consume `orders.status`), and a status batch and the relay's mark of
//! its `order.placed` rows (migration 0010's trigger). Taken in two orders, each would hold a job
//! the other needs next: a deadlock, which Postgres breaks only after `deadlock_timeout`, a second,
//! by failing one of them.

use std::time::Duration;

use messaging::{consumer::Handler, contracts::Contract, envelope::Incoming};
use orders_api::{
    MIGRATOR,
    status::{self, JobStatus},
};
use serde::Serialize;
use shop::{InventoryReserved, InvoiceCreated};
use sqlx::{PgConnection, PgPool};
use testkit::{TestEnv, eventually};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(10);

/// A job, its order, and the id of its `order.placed` outbox row's message.
#[derive(Debug, Clone, Copy)]
struct Job {
    id: Uuid,
    order_id: Uuid,
    message_id: Uuid,
}

/// Two queued jobs with their orders, the first of the lower id.
async fn two_jobs(pool: &PgPool) -> (Job, Job) {
    let mut jobs = Vec::new();
    for _ in 0..2 {
        let job = Job { id: Uuid::now_v7(), order_id: Uuid::now_v7(), message_id: Uuid::now_v7() };
        sqlx::query("insert into orders (id, customer_id) values ($1, 'c')")
            .bind(job.order_id)
            .execute(pool)
            .await
            .expect("order");
        sqlx::query("insert into jobs (id, order_id, order_placed_message_id) values ($1, $2, $3)")
            .bind(job.id)
            .bind(job.order_id)
            .bind(job.message_id)
            .execute(pool)
            .await
            .expect("job");
        jobs.push(job);
    }
    jobs.sort_by_key(|job| job.id);
    (jobs[0], jobs[1])
}

/// `event` as the consumer receives it; with `correlated`, its job in the envelope too (without,
/// the job is the one its body names).
fn incoming<C: Contract + Serialize>(event: &C, correlated: bool) -> Incoming {
    Incoming {
        message_id: Uuid::now_v7(),
        message_type: C::TYPE.to_owned(),
        version: C::VERSION,
        correlation_id: if correlated { event.job() } else { None },
        retry_count: 0,
        ordering: None,
        body: serde_json::to_vec(event).expect("json"),
    }
}

fn reserved(job: Job) -> Incoming {
    let event =
        InventoryReserved { order_id: job.order_id, job_id: job.id, reservation_id: Uuid::now_v7(), lines: Vec::new() };
    incoming(&event, true)
}

fn invoiced(job: Job) -> Incoming {
    let event = InvoiceCreated { order_id: job.order_id, job_id: job.id, invoice_id: Uuid::now_v7(), total_cents: 1 };
    incoming(&event, false)
}

/// Lock a batch, then apply each of its events, as the consumer runtime does in a batch's
/// transaction.
async fn lock_and_apply(handler: &impl Handler, batch: &[Incoming], tx: &mut PgConnection) {
    let members: Vec<&Incoming> = batch.iter().collect();
    handler.lock_batch(&members, tx).await.expect("lock the batch's jobs");
    apply(handler, batch, tx).await;
}

async fn apply(handler: &impl Handler, batch: &[Incoming], tx: &mut PgConnection) {
    for event in batch {
        handler.handle(event, tx).await.expect("apply");
    }
}

/// Sessions on this test's database waiting for a lock.
async fn waiting(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

async fn waits_for_a_lock(pool: &PgPool, what: &str) {
    eventually(what, WAIT, || async { (waiting(pool).await > 0).then_some(()) }).await;
}

async fn states(pool: &PgPool, jobs: [Job; 2]) -> Vec<(String, String)> {
    let mut states = Vec::new();
    for job in jobs {
        let state =
            sqlx::query_as("select j.state, o.status from jobs j join orders o on o.id = j.order_id where j.id = $1")
                .bind(job.id)
                .fetch_one(pool)
                .await
                .expect("job");
        states.push(state);
    }
    states
}

#[tokio::test]
async fn two_status_batches_that_share_jobs_wait_for_each_other_instead_of_deadlocking() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &MIGRATOR).await;
    let (low, high) = two_jobs(&pool).await;
    let handler = status::handler(JobStatus::default());
    // Applied one event at a time, these two would deadlock: the first moves the high job, the
    // second the low one, and each then waits for the other's. Their contracts differ, and the
    // job is named by the envelope in some and by the body alone in others.
    let first = [invoiced(high), reserved(low)];
    let second = [invoiced(low), reserved(high)];

    let mut first_tx = pool.begin().await.expect("begin");
    let first_members: Vec<&Incoming> = first.iter().collect();
    handler.lock_batch(&first_members, &mut first_tx).await.expect("lock the first batch's jobs");
    let second_batch = tokio::spawn({
        let pool = pool.clone();
        async move {
            let handler = status::handler(JobStatus::default());
            let mut tx = pool.begin().await.expect("begin");
            lock_and_apply(&handler, &second, &mut tx).await;
            tx.commit().await.expect("commit the second batch");
        }
    });
    // The second batch waits at its lock, holding no job: the first batch's events then find every
    // row they need already theirs.
    waits_for_a_lock(&pool, "the second batch to wait for the first's jobs").await;
    tokio::time::timeout(WAIT, apply(&handler, &first, &mut first_tx))
        .await
        .expect("the first batch's events wait for no row");
    first_tx.commit().await.expect("commit the first batch");
    tokio::time::timeout(WAIT, second_batch)
        .await
        .expect("the second batch goes on once the first commits")
        .expect("the second batch's task");

    let invoiced = ("succeeded".to_owned(), "invoiced".to_owned());
    assert_eq!(states(&pool, [low, high]).await, [invoiced.clone(), invoiced]);
}

#[tokio::test]
async fn the_relays_mark_takes_its_jobs_in_id_order_as_a_status_batch_does() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &MIGRATOR).await;
    let (low, high) = two_jobs(&pool).await;
    // The high job's row is written to the outbox first: an UPDATE that moved the jobs in the
    // outbox's order would take the high job first.
    let mut rows: Vec<i64> = Vec::new();
    for job in [high, low] {
        let id = sqlx::query_scalar(
            "insert into outbox (message_id, message_type, exchange, routing_key, payload)
             values ($1, 'order.placed', 'orders', 'order.placed', '{}') returning id",
        )
        .bind(job.message_id)
        .fetch_one(&pool)
        .await
        .expect("outbox row");
        rows.push(id);
    }

    // A status batch of both jobs has locked the low one, and is about to lock the high one.
    let mut batch = pool.begin().await.expect("begin");
    sqlx::query("select 1 from jobs where id = $1 for update").bind(low.id).execute(&mut *batch).await.expect("lock");
    // The relay marks both rows, as it marks a batch.
    let mark = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query("update outbox set published_at = now(), last_error = null where id = any($1)")
                .bind(rows)
                .execute(&pool)
                .await
                .expect("mark")
        }
    });
    waits_for_a_lock(&pool, "the relay's mark to wait for the low job").await;
    // Waiting for the low job, the mark holds no other: the batch takes the high one at once.
    sqlx::query("select 1 from jobs where id = $1 for update nowait")
        .bind(high.id)
        .execute(&mut *batch)
        .await
        .expect("the high job is not held by the relay's mark");
    batch.commit().await.expect("commit the batch");
    let marked = tokio::time::timeout(WAIT, mark).await.expect("the mark goes on").expect("the mark's task");
    assert_eq!(marked.rows_affected(), 2);

    let published = ("published".to_owned(), "accepted".to_owned());
    assert_eq!(states(&pool, [low, high]).await, [published.clone(), published]);
}
