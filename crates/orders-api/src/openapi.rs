//! The OpenAPI document of the HTTP surface, generated from the handlers' annotations and the
//! request and response types (`utoipa`), so that it cannot drift from the code. Served at
//! `GET /openapi.json` and kept in `docs/openapi.json` (a test fails if that copy is stale; CI fuzzes
//! the running API from it with schemathesis).
//!
//! The health routes and the live page are served by shared code (`messaging::runtime::health`, the page's
//! HTML); they are described here by the functions below, which only carry their annotations.

use axum::{Json, Router, routing::get};
use utoipa::OpenApi;

use crate::{api, console, jobs, order, overview, problem, story};

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "orders-api",
        description = "Accepts orders and reports their jobs (the reliable-orders reference: transactional outbox, inbox, retries and parking over Postgres and RabbitMQ). Every error is an RFC 9457 problem document.",
        license(name = "MIT OR Apache-2.0"),
    ),
    paths(
        api::place_order,
        api::get_job,
        api::get_job_events,
        api::get_order,
        api::cancel_order,
        overview_page,
        overview_data,
        console::list,
        console::redrive,
        console::abandon,
        console::purge,
        healthz,
        readyz,
        metrics,
        openapi_json
    ),
    components(schemas(
        api::PlaceOrder,
        api::OrderLineRequest,
        order::Accepted,
        order::OrderStatus,
        api::Job,
        api::Order,
        jobs::JobState,
        story::Story,
        story::Event,
        story::Kind,
        problem::Problem,
        overview::Overview,
        overview::JobRow,
        overview::EndpointCounts,
        overview::OutboxBacklog,
        overview::ParkingQueue,
        console::Parked,
        console::Group,
        console::Message,
        console::Selection,
        console::RedriveRequest,
        console::Outcome,
        msgctl::parked::Summary,
        msgctl::parked::Details,
        msgctl::parked::Verdict,
        msgctl::parked::Done,
        Liveness,
        Readiness,
    )),
    modifiers(&BearerScheme),
    tags((name = "orders", description = "Orders and their jobs"), (name = "operations", description = "Health, metrics and the live page"))
)]
pub struct ApiDoc;

/// The `bearer` security scheme the changing routes name: a JWT (`crate::auth`).
struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .bearer_format("JWT")
            .description(Some(
                "A JWT checked against AUTH_JWT_KEY: `sub` is the customer; `scope` holding `operator` makes it an \
                 operator's",
            ))
            .build();
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme("bearer", SecurityScheme::Http(scheme));
    }
}

/// The document as pretty JSON, as served and as kept in `docs/openapi.json`.
pub fn json() -> String {
    // The document is built from static annotations: serialising it cannot fail.
    ApiDoc::openapi().to_pretty_json().unwrap_or_default() + "\n"
}

/// `GET /openapi.json`.
pub fn routes() -> Router {
    Router::new().route("/openapi.json", get(|| async { Json(ApiDoc::openapi()) }))
}

/// `GET /healthz` body.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct Liveness {
    /// Always `ok`.
    status: String,
}

/// `GET /readyz` body.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct Readiness {
    /// `ready` or `not ready`.
    status: String,
    /// What is not ready: each database that does not answer or refuses writes.
    failing: Vec<String>,
    /// Each broker session that is down: reported, not a reason to be not ready (orders are
    /// taken into the outbox while the broker is away).
    #[schema(rename = "brokerFailing")]
    broker_failing: Vec<String>,
    /// The broker node (`host:port`, one of `AMQP_URL`'s) each connected broker session is on, by
    /// session.
    #[schema(rename = "brokerNodes")]
    broker_nodes: std::collections::BTreeMap<String, String>,
}

/// The live page: recent jobs, per-endpoint counts, outbox backlogs and parking, refreshed every
/// second from `/overview`.
#[utoipa::path(get, path = "/", tag = "operations",
    responses((status = 200, description = "The page.", content_type = "text/html", body = String)))]
#[allow(dead_code)]
fn overview_page() {}

/// What the live page shows, as JSON: for operators' tokens only.
#[utoipa::path(get, path = "/overview", tag = "operations",
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The figures.", body = overview::Overview),
        (status = 401, description = "No bearer token, or one refused.", body = problem::Problem, content_type = "application/problem+json",
         headers(("WWW-Authenticate" = String, description = "`Bearer realm=\"orders\"`"))),
        (status = 403, description = "Not an operator's token.", body = problem::Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database is unreachable, or busy (a lock or a statement past its timeout, a deadlock): nothing was written; retry later.", body = problem::Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds"))),
    ))]
#[allow(dead_code)]
fn overview_data() {}

/// Liveness: the process runs.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "Alive.", body = Liveness)))]
#[allow(dead_code)]
fn healthz() {}

/// Readiness: the database answers and takes writes. The broker's sessions are reported beside it
/// (`brokerFailing`), not required: orders are taken into the outbox while the broker is away.
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses(
        (status = 200, description = "Ready.", body = Readiness),
        (status = 503, description = "Not ready: `failing` says what.", body = Readiness),
    ))]
#[allow(dead_code)]
fn readyz() {}

/// Prometheus metrics (OpenMetrics text format).
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "The metrics.", content_type = "application/openmetrics-text", body = String)))]
#[allow(dead_code)]
fn metrics() {}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI document.", body = Object)))]
#[allow(dead_code)]
fn openapi_json() {}

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/openapi.json` is the document the code generates: regenerate it with
    /// `UPDATE_OPENAPI=1 cargo test -p orders-api openapi`.
    #[test]
    fn docs_openapi_json_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
        let generated = json();
        if std::env::var_os("UPDATE_OPENAPI").is_some() {
            std::fs::write(&path, &generated).expect("write docs/openapi.json");
        }
        let kept = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            kept == generated,
            "docs/openapi.json is stale: run `UPDATE_OPENAPI=1 cargo test -p orders-api openapi` and commit it"
        );
    }

    #[test]
    fn every_route_of_the_app_is_documented() {
        let document = ApiDoc::openapi();
        let documented: Vec<&str> = document.paths.paths.keys().map(String::as_str).collect();
        for path in [
            "/orders",
            "/orders/{orderId}",
            "/jobs/{jobId}",
            "/",
            "/overview",
            "/healthz",
            "/readyz",
            "/metrics",
            "/openapi.json",
        ] {
            assert!(documented.contains(&path), "{path} is not documented: {documented:?}");
        }
    }
}
