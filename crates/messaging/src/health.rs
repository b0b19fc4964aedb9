//! `/healthz`, `/readyz` and `/metrics`, served by every binary (the API merges them into its own
//! router). Liveness says the process runs; readiness says its databases answer and each of its
//! broker sessions is up.

use std::{collections::BTreeMap, sync::Arc, sync::Mutex, time::Duration};

use axum::{
    Json, Router,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::get,
};
use sqlx::PgPool;

use crate::{
    metrics::{Metrics, render_gauge},
    outbox,
    shutdown::Shutdown,
};

/// Named readiness flags: each long-running session (a consumer, a relay loop) sets its own.
#[derive(Debug, Default)]
pub struct Readiness {
    flags: Mutex<BTreeMap<String, bool>>,
}

impl Readiness {
    /// Set flag `name`. A change is logged once, when it happens, not at every probe.
    pub fn set(&self, name: &str, ready: bool) {
        let mut flags = self.flags.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match (flags.insert(name.to_owned(), ready), ready) {
            (Some(false) | None, true) => tracing::info!(what = name, "ready"),
            (Some(true), false) => tracing::warn!(what = name, "not ready"),
            _ => {}
        }
    }

    /// The flags that are not ready.
    pub fn failing(&self) -> Vec<String> {
        let flags = self.flags.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        flags.iter().filter(|(_, ready)| !**ready).map(|(name, _)| name.clone()).collect()
    }
}

/// What the health endpoints look at.
#[derive(Clone, Default)]
pub struct Health {
    /// Counters for `/metrics`.
    pub metrics: Arc<Metrics>,
    /// Session flags for `/readyz`.
    pub readiness: Arc<Readiness>,
    /// Databases to ping, with the label their outbox gauges carry.
    pub databases: Vec<(String, PgPool)>,
}

/// The three health routes.
pub fn routes(health: Health) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(serde_json::json!({ "status": "ok" })) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(health)
}

async fn readyz(State(health): State<Health>) -> impl IntoResponse {
    for (name, pool) in &health.databases {
        health.readiness.set(&format!("database:{name}"), crate::db::answers(pool).await);
    }
    let failing = health.readiness.failing();
    let status = if failing.is_empty() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body =
        serde_json::json!({ "status": if failing.is_empty() { "ready" } else { "not ready" }, "failing": failing });
    (status, Json(body))
}

async fn metrics(State(health): State<Health>) -> impl IntoResponse {
    let mut out = String::new();
    health.metrics.render(&mut out);
    // A database that is down only loses its gauges; the counters still render.
    let mut outboxes = Vec::new();
    for (name, pool) in &health.databases {
        if let Ok(Ok(counts)) = tokio::time::timeout(Duration::from_secs(2), outbox::counts(pool)).await {
            outboxes.push((name.as_str(), counts));
        }
    }
    // Each metric family's samples together, as the exposition format requires.
    let help = "Outbox rows by state (published rows are kept until retention deletes them).";
    for (i, (name, counts)) in outboxes.iter().enumerate() {
        for (state, rows) in [("published", counts.published), ("unpublished", counts.unpublished)] {
            let labels = [("database", *name), ("state", state)];
            render_gauge(&mut out, "outbox_rows", help, &labels, rows as f64, i == 0 && state == "published");
        }
    }
    let help = "Seconds the oldest unpublished outbox row has waited (0 when none waits).";
    for (i, (database, counts)) in outboxes.iter().enumerate() {
        let (name, labels) = ("outbox_oldest_unpublished_age_seconds", [("database", *database)]);
        render_gauge(&mut out, name, help, &labels, counts.oldest_unpublished_age_seconds, i == 0);
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}

/// Serve `router` on `listener` until shutdown, then finish in-flight requests.
pub async fn serve(listener: tokio::net::TcpListener, router: Router, shutdown: Shutdown) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(async move { shutdown.triggered().await }).await
}
