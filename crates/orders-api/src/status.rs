//! The orders status consumer (endpoint `orders.status`): moves jobs and orders along as the other
//! services report. Updates are monotonic: a terminal state (succeeded, rejected, quarantined)
//! never changes again and attempt numbers only grow, so late or reordered events are harmless.

use messaging::{
    consumer::{Context, Handle, HandlerError, Routes},
    contracts::{JOBS_EXCHANGE, JobQuarantined, JobRedriven, JobRetryScheduled},
    topology::Endpoint,
};
use shop::{InventoryRejected, InventoryReserved, InvoiceCreated};
use std::sync::Arc;

use chrono::Utc;
use messaging::runtime::metrics::Metrics;
use sqlx::PgConnection;

use crate::{
    jobs::{self, Applied, JobState, OrderMove},
    order::OrderStatus,
};

/// The endpoint of inventory's step (it consumes `order.placed`).
const INVENTORY_ENDPOINT: &str = "inventory.order-placed";

/// The endpoint: every outcome of every step, and the runtime's job events.
pub fn endpoint() -> Endpoint {
    Endpoint::new("orders.status")
        .consume::<InventoryReserved>()
        .consume::<InventoryRejected>()
        .consume::<InvoiceCreated>()
        .bind(JOBS_EXCHANGE, "job.#")
        .accept::<JobRetryScheduled>()
        .accept::<JobQuarantined>()
        .accept::<JobRedriven>()
}

/// The endpoint's handler: every contract it accepts to [`JobStatus`].
pub fn handler(status: JobStatus) -> Routes<JobStatus> {
    Routes::new(status)
        .on::<InventoryReserved>()
        .on::<InventoryRejected>()
        .on::<InvoiceCreated>()
        .on::<JobRetryScheduled>()
        .on::<JobQuarantined>()
        .on::<JobRedriven>()
}

/// The handler: one `Handle` per contract.
#[derive(Debug, Clone, Default)]
pub struct JobStatus {
    /// Where each job's duration is recorded when it ends.
    pub metrics: Arc<Metrics>,
}

impl JobStatus {
    /// Record the duration of a job that has just ended in `state`.
    fn ended(&self, state: JobState, created_at: jobs::Ended) {
        if let Some(created_at) = created_at {
            let seconds = (Utc::now() - created_at).to_std().unwrap_or_default().as_secs_f64();
            self.metrics.job_ended(state.as_str(), seconds);
        }
    }
}

/// What an event found ([`Applied`]); an event for a job this database does not have is parked,
/// with the reason (counted, alerted on and listed as every parked message is), rather than
/// updating no row and passing unseen.
fn known(job_id: uuid::Uuid, applied: Applied) -> Result<jobs::Ended, HandlerError> {
    match applied {
        Applied::Job(ended) => Ok(ended),
        Applied::UnknownJob => Err(unknown_job(job_id)),
    }
}

fn unknown_job(job_id: uuid::Uuid) -> HandlerError {
    HandlerError::Permanent(
        format!(
            "no job {job_id} in the orders database: most likely a commit that a failover to a \
             standby lost after its message was published; else a message from another deployment"
        )
        .into(),
    )
}

// Seeing a downstream result proves order.placed left: queued -> published, in case this event
// overtook the relay's own mark; and inventory's step is done, so a job waiting on its retry is not
// waiting any more.
impl Handle<InventoryReserved> for JobStatus {
    async fn handle(&self, event: InventoryReserved, _: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let order = OrderMove { order_id: event.order_id, to: OrderStatus::Reserved };
        known(event.job_id, jobs::step_succeeded(tx, event.job_id, INVENTORY_ENDPOINT, order).await?)?;
        Ok(())
    }
}

impl Handle<InventoryRejected> for JobStatus {
    async fn handle(&self, event: InventoryRejected, _: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let order = OrderMove { order_id: event.order_id, to: OrderStatus::Rejected };
        let applied = jobs::ended(tx, event.job_id, JobState::Rejected, None, Some(&event.reason), order).await?;
        let ended = known(event.job_id, applied)?;
        self.ended(JobState::Rejected, ended);
        Ok(())
    }
}

impl Handle<InvoiceCreated> for JobStatus {
    async fn handle(&self, event: InvoiceCreated, _: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let invoice_id = event.invoice_id.to_string();
        let order = OrderMove { order_id: event.order_id, to: OrderStatus::Invoiced };
        let applied = jobs::ended(tx, event.job_id, JobState::Succeeded, Some(&invoice_id), None, order).await?;
        let ended = known(event.job_id, applied)?;
        self.ended(JobState::Succeeded, ended);
        Ok(())
    }
}

impl Handle<JobRetryScheduled> for JobStatus {
    async fn handle(&self, event: JobRetryScheduled, _: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        known(event.job_id, jobs::retry_scheduled(tx, &event, INVENTORY_ENDPOINT).await?)?;
        Ok(())
    }
}

impl Handle<JobQuarantined> for JobStatus {
    async fn handle(&self, event: JobQuarantined, _: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let applied =
            jobs::quarantined(tx, event.job_id, &event.endpoint, event.attempt, &event.error, event.redrive_count)
                .await?;
        let ended = known(event.job_id, applied)?;
        self.ended(JobState::Quarantined, ended);
        jobs::move_order_of(tx, event.job_id, OrderStatus::Failed).await?;
        Ok(())
    }
}

impl Handle<JobRedriven> for JobStatus {
    async fn handle(&self, event: JobRedriven, _: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        // The order starts over from `accepted`: the redriven step's result moves it on.
        match jobs::redriven(tx, event.job_id, &event.endpoint, event.redrive_count).await? {
            Some(true) => jobs::move_order_of(tx, event.job_id, OrderStatus::Accepted).await?,
            Some(false) => {}
            None => return Err(unknown_job(event.job_id)),
        }
        Ok(())
    }
}
