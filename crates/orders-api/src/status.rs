//! The orders status consumer (endpoint `orders.status`): moves jobs and orders along as the other
//! services report, and decides each order's end (decision 0023). Updates are monotonic: an
//! order's end never changes once decided, and attempt numbers only grow, so late or reordered
//! events are harmless.

use messaging::{
    contracts::{JobAbandoned, JobQuarantined, JobRedriven, JobRetryScheduled},
    handler::{Context, Handle, HandlerError, Routes},
    topology::Endpoint,
};
use shop::{
    End, InventoryRejected, InventoryReleased, InventoryReserved, InvoiceCreated, InvoiceVoided, OrderDeadline,
    PaymentDeclined,
};
use std::sync::Arc;

use chrono::Utc;
use messaging::runtime::metrics::Metrics;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::{
    jobs::{self, Applied, Compensated, Decided, JobState, OrderMove, Undone},
    order::OrderStatus,
    story::{self, Kind, Step},
};

/// The endpoint of inventory's step ([`shop::topology::inventory`]).
const INVENTORY_ENDPOINT: &str = "inventory.order-placed";

/// Why an order whose deadline came was cancelled.
pub const DEADLINE_REASON: &str = "cancelled: the order's deadline passed before it ended";

/// The endpoint: every outcome of every step, the compensations' answers, the orders' own
/// deadlines, and the runtime's job events ([`shop::topology::orders_status`]).
pub fn endpoint() -> Endpoint {
    shop::topology::orders_status()
}

/// The endpoint's handler: every contract it accepts to [`JobStatus`].
pub fn handler(status: JobStatus) -> Routes<JobStatus> {
    Routes::new(status)
        .on::<InventoryReserved>()
        .on::<InventoryRejected>()
        .on::<InventoryReleased>()
        .on::<InvoiceCreated>()
        .on::<PaymentDeclined>()
        .on::<InvoiceVoided>()
        .on::<OrderDeadline>()
        .on::<JobRetryScheduled>()
        .on::<JobQuarantined>()
        .on::<JobRedriven>()
        .on::<JobAbandoned>()
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

    /// Decide the job's order's end ([`jobs::decide`]), unless it has one. A job that succeeds is
    /// recorded as ended; one that compensates, once its compensations have answered.
    async fn decide(
        &self,
        tx: &mut PgConnection,
        job_id: Uuid,
        end: End,
        reason: Option<&str>,
        result_key: Option<&str>,
    ) -> Result<(), HandlerError> {
        match jobs::decide(tx, job_id, end, reason, result_key).await? {
            Decided::UnknownJob => Err(unknown_job(job_id)),
            Decided::Before => Ok(()),
            Decided::Now(created_at, _) => {
                if end == End::Invoiced {
                    self.ended(JobState::Succeeded, Some(created_at));
                }
                Ok(())
            }
        }
    }

    /// A compensation answered ([`jobs::compensated`]).
    async fn compensated(&self, tx: &mut PgConnection, job_id: Uuid, undone: Undone) -> Result<(), HandlerError> {
        match jobs::compensated(tx, job_id, undone).await? {
            Compensated::UnknownJob => Err(unknown_job(job_id)),
            Compensated::Waiting => Ok(()),
            Compensated::Ended(state, created_at) => {
                self.ended(state, Some(created_at));
                Ok(())
            }
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

/// Record in the job's story that its event `kind` came, first (what it causes follows).
async fn heard(
    tx: &mut PgConnection,
    context: &Context,
    job_id: Uuid,
    kind: Kind,
    step: Step<'_>,
) -> Result<(), HandlerError> {
    let step = Step { message_id: Some(context.message_id), ..step };
    story::record(tx, job_id, kind, step).await?;
    Ok(())
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
    async fn handle(&self, event: InventoryReserved, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        heard(tx, cx, event.job_id, Kind::Reserved, Step { endpoint: Some(INVENTORY_ENDPOINT), ..Step::default() })
            .await?;
        let order = OrderMove { order_id: event.order_id, to: OrderStatus::Reserved };
        known(event.job_id, jobs::step_succeeded(tx, event.job_id, INVENTORY_ENDPOINT, order).await?)?;
        Ok(())
    }
}

impl Handle<InventoryRejected> for JobStatus {
    async fn handle(&self, event: InventoryRejected, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let step = Step { endpoint: Some(INVENTORY_ENDPOINT), detail: Some(&event.reason), ..Step::default() };
        heard(tx, cx, event.job_id, Kind::Rejected, step).await?;
        let applied = jobs::rejected(tx, event.job_id, event.order_id, &event.reason).await?;
        let ended = known(event.job_id, applied)?;
        self.ended(JobState::Rejected, ended);
        Ok(())
    }
}

// The invoice decides the order's end, unless it has one: an order cancelled meanwhile stays
// cancelled, and billing voids the invoice when it gets the order's `order.ended`.
impl Handle<InvoiceCreated> for JobStatus {
    async fn handle(&self, event: InvoiceCreated, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let invoice_id = event.invoice_id.to_string();
        heard(tx, cx, event.job_id, Kind::Invoiced, Step { detail: Some(&invoice_id), ..Step::default() }).await?;
        self.decide(tx, event.job_id, End::Invoiced, None, Some(&invoice_id)).await
    }
}

impl Handle<PaymentDeclined> for JobStatus {
    async fn handle(&self, event: PaymentDeclined, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        heard(tx, cx, event.job_id, Kind::Declined, Step { detail: Some(&event.reason), ..Step::default() }).await?;
        self.decide(tx, event.job_id, End::Declined, Some(&event.reason), None).await
    }
}

// A deadline that comes after the order ended finds it decided, and does nothing.
impl Handle<OrderDeadline> for JobStatus {
    async fn handle(&self, event: OrderDeadline, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        heard(tx, cx, event.job_id, Kind::DeadlineCame, Step::default()).await?;
        self.decide(tx, event.job_id, End::Cancelled, Some(DEADLINE_REASON), None).await
    }
}

impl Handle<InventoryReleased> for JobStatus {
    async fn handle(&self, event: InventoryReleased, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        heard(tx, cx, event.job_id, Kind::Released, Step::default()).await?;
        self.compensated(tx, event.job_id, Undone::Released).await
    }
}

impl Handle<InvoiceVoided> for JobStatus {
    async fn handle(&self, event: InvoiceVoided, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        heard(tx, cx, event.job_id, Kind::Voided, Step::default()).await?;
        self.compensated(tx, event.job_id, Undone::Voided).await
    }
}

impl Handle<JobRetryScheduled> for JobStatus {
    async fn handle(&self, event: JobRetryScheduled, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let step = Step {
            endpoint: Some(&event.endpoint),
            attempt: Some(event.attempt),
            due_at: Some(event.next_attempt_at),
            detail: Some(&event.error),
            ..Step::default()
        };
        heard(tx, cx, event.job_id, Kind::RetryScheduled, step).await?;
        known(event.job_id, jobs::retry_scheduled(tx, &event, INVENTORY_ENDPOINT).await?)?;
        Ok(())
    }
}

impl Handle<JobQuarantined> for JobStatus {
    async fn handle(&self, event: JobQuarantined, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let step = Step {
            endpoint: Some(&event.endpoint),
            attempt: Some(event.attempt),
            detail: Some(&event.error),
            ..Step::default()
        };
        heard(tx, cx, event.job_id, Kind::Parked, step).await?;
        let applied =
            jobs::quarantined(tx, event.job_id, &event.endpoint, event.attempt, &event.error, event.redrive_count)
                .await?;
        let ended = known(event.job_id, applied)?;
        self.ended(JobState::Quarantined, ended);
        jobs::move_order_of(tx, event.job_id, OrderStatus::Failed).await?;
        // The relay parked the order's placing?
        if let Some(message_id) = event.message_id {
            jobs::placing_lost_after_end(tx, event.job_id, &event.endpoint, message_id).await?;
        }
        Ok(())
    }
}

// An operator gave up on the job's parked message: the order is cancelled (unless it ended) and
// compensated, and the step's message is no longer parked (it was acked after this was confirmed).
impl Handle<JobAbandoned> for JobStatus {
    async fn handle(&self, event: JobAbandoned, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let step = Step { endpoint: Some(&event.endpoint), detail: Some(&event.reason), ..Step::default() };
        heard(tx, cx, event.job_id, Kind::Abandoned, step).await?;
        let reason = format!("abandoned by an operator: {}", event.reason);
        // First: an end decided before, sent ordered behind this placing (discarded from the
        // outbox: `msgctl outbox discard`), must not wait for it.
        jobs::placing_lost_after_end(tx, event.job_id, &event.endpoint, event.message_id).await?;
        self.decide(tx, event.job_id, End::Cancelled, Some(&reason), None).await?;
        jobs::step_abandoned(tx, event.job_id, &event.endpoint).await?;
        Ok(())
    }
}

impl Handle<JobRedriven> for JobStatus {
    async fn handle(&self, event: JobRedriven, cx: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let detail = format!("redrive {}", event.redrive_count);
        let step = Step { endpoint: Some(&event.endpoint), detail: Some(&detail), ..Step::default() };
        heard(tx, cx, event.job_id, Kind::Redriven, step).await?;
        // The order starts over from `accepted`: the redriven step's result moves it on.
        match jobs::redriven(tx, event.job_id, &event.endpoint, event.redrive_count).await? {
            Some(true) => jobs::move_order_of(tx, event.job_id, OrderStatus::Accepted).await?,
            Some(false) => {}
            None => return Err(unknown_job(event.job_id)),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The routes say what `orders.status` accepts and the topology what reaches it: each route's
    /// contract must be bound (or nothing would arrive, and the relay would not hold it), and each
    /// contract bound by name must be routed (or it would be parked on arrival).
    #[test]
    fn the_status_endpoint_binds_every_contract_it_routes_and_routes_every_one_it_binds() {
        let (endpoint, handler) = (endpoint(), handler(JobStatus::default()));
        assert_eq!(handler.contracts().count(), 11);
        for (message_type, exchange) in handler.contracts() {
            assert!(endpoint.receives(exchange, message_type), "{message_type} on {exchange} is routed but not bound");
        }
        for binding in endpoint.bindings.iter().filter(|binding| !binding.routing_key.contains(['*', '#'])) {
            assert!(
                handler.types().any(|t| t == binding.routing_key),
                "{} is bound but not routed",
                binding.routing_key
            );
        }
    }
}
