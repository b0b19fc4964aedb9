//! The orders status consumer (endpoint `orders.status`): moves jobs and orders along as the other
//! services report. Updates are monotonic: a terminal state (succeeded, rejected, quarantined)
//! never changes again and attempt numbers only grow, so late or reordered events are harmless.

use messaging::{
    consumer::{Handler, HandlerError},
    contracts::{
        Contract, InventoryRejected, InventoryReserved, InvoiceCreated, JobQuarantined, JobRetryScheduled, exchanges,
    },
    envelope::{Incoming, Unreadable},
    topology::Endpoint,
};
use sqlx::PgConnection;
use uuid::Uuid;

/// Job states that never change again.
const TERMINAL: &str = "('succeeded', 'rejected', 'quarantined')";
/// The endpoint of inventory's step (it consumes `order.placed`).
const INVENTORY_ENDPOINT: &str = "inventory.order-placed";

/// The endpoint: every outcome of every step, and the runtime's job events.
pub fn endpoint() -> Endpoint {
    Endpoint::new("orders.status")
        .bind(exchanges::INVENTORY, InventoryReserved::TYPE)
        .bind(exchanges::INVENTORY, InventoryRejected::TYPE)
        .bind(exchanges::BILLING, InvoiceCreated::TYPE)
        .bind(exchanges::JOBS, "job.#")
        .accept::<InventoryReserved>()
        .accept::<InventoryRejected>()
        .accept::<InvoiceCreated>()
        .accept::<JobRetryScheduled>()
        .accept::<JobQuarantined>()
}

/// The handler.
#[derive(Debug, Clone, Default)]
pub struct JobStatus;

impl Handler for JobStatus {
    async fn handle(&self, message: &Incoming, tx: &mut PgConnection) -> Result<(), HandlerError> {
        match message.message_type.as_str() {
            InventoryReserved::TYPE => {
                let event: InventoryReserved = message.json()?;
                // Seeing a downstream result proves order.placed left: queued -> published, in
                // case this event overtook the relay's own mark; and inventory's step is done, so a
                // job waiting on its retry is not waiting any more.
                progress(tx, event.job_id, INVENTORY_ENDPOINT).await?;
                set_order_status(tx, event.order_id, "reserved", &["accepted"]).await?;
            }
            InventoryRejected::TYPE => {
                let event: InventoryRejected = message.json()?;
                finish(tx, event.job_id, "rejected", None, Some(&event.reason)).await?;
                set_order_status(tx, event.order_id, "rejected", &["accepted", "reserved"]).await?;
            }
            InvoiceCreated::TYPE => {
                let event: InvoiceCreated = message.json()?;
                finish(tx, event.job_id, "succeeded", Some(&event.invoice_id.to_string()), None).await?;
                set_order_status(tx, event.order_id, "invoiced", &["accepted", "reserved"]).await?;
            }
            JobRetryScheduled::TYPE => {
                let event: JobRetryScheduled = message.json()?;
                retry_scheduled(tx, &event).await?;
            }
            JobQuarantined::TYPE => {
                let event: JobQuarantined = message.json()?;
                quarantine(tx, event.job_id, event.attempt, &event.error).await?;
                sqlx::query(
                    "update orders set status = 'failed', updated_at = now()
                      where id = (select order_id from jobs where id = $1) and status in ('accepted', 'reserved')",
                )
                .bind(event.job_id)
                .execute(&mut *tx)
                .await?;
            }
            // The runtime only hands over accepted types; this is a programming error.
            other => return Err(Unreadable::UnknownType(other.to_owned()).into()),
        }
        Ok(())
    }
}

/// A step's message was parked: the job is quarantined, unless it already ended; the attempt only
/// grows.
async fn quarantine(tx: &mut PgConnection, job_id: Uuid, attempt: u32, error: &str) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "update jobs set state = 'quarantined', attempt = greatest(attempt, $2), last_error = $3, updated_at = now()
          where id = $1 and state not in {TERMINAL}"
    ))
    .bind(job_id)
    .bind(i32::try_from(attempt).unwrap_or(i32::MAX))
    .bind(error)
    .execute(tx)
    .await
    .map(drop)
}

/// A step is waiting for a retry. A late event from a step that has already succeeded (inventory,
/// once the order is reserved) changes nothing: the job must not look older than it is.
async fn retry_scheduled(tx: &mut PgConnection, event: &JobRetryScheduled) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "update jobs set state = 'retry_wait', retry_endpoint = $2, attempt = greatest(attempt, $3),
                last_error = $4, updated_at = now()
          where id = $1 and state not in {TERMINAL}
            and not ($2 = $5 and exists (select 1 from orders o where o.id = jobs.order_id and o.status <> 'accepted'))"
    ))
    .bind(event.job_id)
    .bind(&event.endpoint)
    .bind(i32::try_from(event.next_attempt).unwrap_or(i32::MAX))
    .bind(&event.error)
    .bind(INVENTORY_ENDPOINT)
    .execute(tx)
    .await
    .map(drop)
}

/// `endpoint`'s step succeeded: a queued job is published, and a job waiting on that step's retry
/// is not waiting any more.
async fn progress(tx: &mut PgConnection, job_id: Uuid, endpoint: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "update jobs set state = 'published', retry_endpoint = null,
                published_at = coalesce(published_at, now()), updated_at = now()
          where id = $1 and (state = 'queued' or (state = 'retry_wait' and retry_endpoint = $2))",
    )
    .bind(job_id)
    .bind(endpoint)
    .execute(tx)
    .await
    .map(drop)
}

async fn finish(
    tx: &mut PgConnection,
    job_id: Uuid,
    state: &str,
    result_key: Option<&str>,
    error: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "update jobs set state = $2, result_key = coalesce($3, result_key), last_error = coalesce($4, last_error),
                published_at = coalesce(published_at, now()), updated_at = now()
          where id = $1 and state not in {TERMINAL}"
    ))
    .bind(job_id)
    .bind(state)
    .bind(result_key)
    .bind(error)
    .execute(tx)
    .await
    .map(drop)
}

async fn set_order_status(
    tx: &mut PgConnection,
    order_id: Uuid,
    status: &str,
    from: &[&str],
) -> Result<(), sqlx::Error> {
    sqlx::query("update orders set status = $2, updated_at = now() where id = $1 and status = any($3)")
        .bind(order_id)
        .bind(status)
        .bind(from)
        .execute(tx)
        .await
        .map(drop)
}
