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
                // case this event overtook the relay's own mark.
                progress(tx, event.job_id).await?;
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
                step_failed(tx, event.job_id, "retry_wait", event.next_attempt, &event.error).await?;
            }
            JobQuarantined::TYPE => {
                let event: JobQuarantined = message.json()?;
                step_failed(tx, event.job_id, "quarantined", event.attempt, &event.error).await?;
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

/// A step failed: the job waits for a retry or is quarantined, unless it already ended; the
/// attempt only grows.
async fn step_failed(
    tx: &mut PgConnection,
    job_id: Uuid,
    state: &str,
    attempt: u32,
    error: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "update jobs set state = $2, attempt = greatest(attempt, $3), last_error = $4, updated_at = now()
          where id = $1 and state not in {TERMINAL}"
    ))
    .bind(job_id)
    .bind(state)
    .bind(i32::try_from(attempt).unwrap_or(i32::MAX))
    .bind(error)
    .execute(tx)
    .await
    .map(drop)
}

async fn progress(tx: &mut PgConnection, job_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(
        "update jobs set state = 'published', published_at = coalesce(published_at, now()), updated_at = now()
          where id = $1 and state = 'queued'",
    )
    .bind(job_id)
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
