//! Shipping, the example of `docs/adding-a-service.md`: consumes `order.ended` (endpoint
//! `shipping.order-ended`), schedules one shipment per order that ended invoiced, and announces
//! `shipment.scheduled` through its outbox, all in the runtime's one transaction. It waits for the
//! order's end, decided by the orders service, rather than the invoice: a customer's cancel can
//! still win against an invoice, which billing then voids (decision 0023).
//!
//! It also serves one route of its own beside its health routes, `GET /shipments/{order_id}`
//! ([`routes`]): the shape of a service with an endpoint and a route.
//!
//! The glue is [`worker`], [`MIGRATOR`] and `main.rs`; the rest is the handler, the route and the
//! contract it publishes.

use axum::{
    Json, Router,
    extract::{Path, State},
    http::StatusCode,
    routing::get,
};
use messaging::{
    prelude::*,
    runtime::{problem::Problem, serve},
};
use serde::{Deserialize, Serialize};
use shop::{End, OrderEnded};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// This service's own migrations, applied after messaging's. Named by timestamp
/// (`sqlx migrate add`'s default), so they never take one of messaging's versions.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/shipping");

/// The worker.
pub fn worker() -> Worker<NoFlags, Routes<ScheduleShipment>> {
    Worker {
        name: "shipping-worker",
        about: "Schedules a shipment for every invoiced order.",
        version: env!("CARGO_PKG_VERSION"),
        database: "shipping",
        http_addr: "127.0.0.1:8084",
        migrator: &MIGRATOR,
        // Every end (`order.ended.<end>`, and `order.ended` of releases before routing by end).
        endpoint: Endpoint::new("shipping.order-ended").consume_keys::<OrderEnded>(&[shop::EVERY_END]),
        handler: |_| Routes::new(ScheduleShipment).on::<OrderEnded>(),
        routes: Some(routes),
        prepare: None,
    }
}

/// Its own route, `GET /shipments/{order_id}`: the order's shipment (200), none yet (404), the
/// database unreachable or busy (503, `Retry-After`), each failure an `application/problem+json`
/// document ([`Problem`]); each request in a span named by its route
/// ([`serve::trace_requests`]), as the orders API's are.
pub fn routes(pool: PgPool) -> Router {
    Router::new().route("/shipments/{order_id}", get(shipment)).with_state(pool).layer(serve::trace_requests())
}

/// A scheduled shipment, as `GET /shipments/{order_id}` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct Shipment {
    /// The shipment.
    pub id: Uuid,
    /// The order.
    pub order_id: Uuid,
    /// The job that tracked the order.
    pub job_id: Option<Uuid>,
}

async fn shipment(State(pool): State<PgPool>, Path(order_id): Path<Uuid>) -> Result<Json<Shipment>, Problem> {
    let found = sqlx::query_as("select id, order_id, job_id from shipments where order_id = $1")
        .bind(order_id)
        .fetch_optional(&pool)
        .await
        .map_err(Problem::from_database)?;
    found.map(Json).ok_or_else(|| Problem::new(StatusCode::NOT_FOUND, format!("no shipment for order {order_id}")))
}

/// A shipment was scheduled for an invoiced order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShipmentScheduled {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
    /// The shipment.
    pub shipment_id: Uuid,
}

impl Contract for ShipmentScheduled {
    const TYPE: &'static str = "shipment.scheduled";
    const EXCHANGE: &'static str = "shipping";
}

/// The `order.ended` handler.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScheduleShipment;

impl Handle<OrderEnded> for ScheduleShipment {
    async fn handle(&self, ended: OrderEnded, context: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        // Only an invoiced order ships; every other end is final too, and nothing was done for it.
        if ended.end != End::Invoiced {
            return Ok(());
        }
        let shipment_id = Uuid::now_v7();
        let inserted = sqlx::query(
            "insert into shipments (id, order_id, job_id) values ($1, $2, $3) on conflict (order_id) do nothing",
        )
        .bind(shipment_id)
        .bind(ended.order_id)
        .bind(ended.job_id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        // A redelivery under another message id finds the shipment made, and announces nothing.
        if inserted == 1 {
            let scheduled = ShipmentScheduled { order_id: ended.order_id, job_id: ended.job_id, shipment_id };
            outbox::enqueue(tx, &scheduled, context.job_id).await?;
        }
        Ok(())
    }
}
