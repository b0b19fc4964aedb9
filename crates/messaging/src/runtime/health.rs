//! `/healthz`, `/readyz` and `/metrics`, served by every binary (the API merges them into its own
//! router). Liveness says the process runs; readiness says its databases answer and each of its
//! broker sessions is up (and, for a relay, that its confirms are not overdue), and names the
//! broker node each session is connected to. A service whose work does not need the broker (the
//! API: taking orders while the broker is away is what the outbox is for) reports its broker
//! sessions beside its readiness instead ([`Health::broker_reported_only`]). Every check's time
//! failing is a metric, `readiness_failing_seconds`, whether or not it fails `/readyz`.

use std::{collections::BTreeMap, sync::Arc, sync::Mutex, time::Duration};

use axum::{
    Json, Router,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::get,
};
use messaging_core::outbox;
use sqlx::PgPool;

use crate::runtime::{
    metrics::{self, ByDatabase, ByDatabaseState, Metrics},
    shutdown::Shutdown,
};

/// Named readiness flags: each long-running session (a consumer, a relay loop) sets its own.
#[derive(Debug, Default)]
pub struct Readiness {
    /// Each flag: whether it is ready, and since when it has been as it is.
    flags: Mutex<BTreeMap<String, (bool, chrono::DateTime<chrono::Utc>)>>,
    nodes: Mutex<BTreeMap<String, String>>,
    /// Each broker connection watched, by name: since when, and why, the broker blocks it.
    blocked: Mutex<BTreeMap<String, Option<Blocked>>>,
    /// The links whose last publish went unconfirmed past its deadline on a connection the broker
    /// does not block (a queue without its majority): since when. Not ready until a confirm comes.
    overdue: Mutex<BTreeMap<String, chrono::DateTime<chrono::Utc>>>,
}

/// A connection the broker blocks (`connection.blocked`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Blocked {
    /// When it was blocked.
    pub since: chrono::DateTime<chrono::Utc>,
    /// The broker's reason, e.g. `low on memory`.
    pub reason: String,
}

impl Readiness {
    /// Set flag `name`. A change is logged once, when it happens, not at every probe.
    pub fn set(&self, name: &str, ready: bool) {
        let mut flags = self.flags.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let was = flags.get(name).map(|(was, _)| *was);
        match (was, ready) {
            (Some(false) | None, true) => tracing::info!(what = name, "ready"),
            (Some(true), false) => tracing::warn!(what = name, "not ready"),
            _ => {}
        }
        if was != Some(ready) {
            flags.insert(name.to_owned(), (ready, chrono::Utc::now()));
        }
    }

    /// Record the broker node (`host:port`) session `name` is connected to, or that it is
    /// connected to none.
    pub fn set_node(&self, name: &str, node: Option<&str>) {
        let mut nodes = self.nodes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match node {
            Some(node) => nodes.insert(name.to_owned(), node.to_owned()),
            None => nodes.remove(name),
        };
    }

    /// Each connected session's broker node, by session name.
    pub fn nodes(&self) -> BTreeMap<String, String> {
        self.nodes.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// Record that the broker blocks connection `name` (with its reason) or does not. Logged
    /// when it changes.
    pub fn set_blocked(&self, name: &str, reason: Option<String>) {
        let mut blocked = self.blocked.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = reason.map(|reason| Blocked { since: chrono::Utc::now(), reason });
        match (blocked.get(name).cloned().flatten(), &now) {
            (None, Some(now)) => {
                tracing::warn!(connection = name, reason = now.reason, "the broker blocks this connection")
            }
            (Some(was), None) => {
                tracing::info!(connection = name, since = %was.since, "the broker unblocked this connection")
            }
            // Blocked again while blocked: it has been since the first time.
            (Some(_), Some(_)) => return,
            (None, None) => {}
        }
        blocked.insert(name.to_owned(), now);
    }

    /// Every connection watched, and whether the broker blocks it.
    pub fn blocked(&self) -> BTreeMap<String, Option<Blocked>> {
        self.blocked.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// Record that link `name`'s confirms are overdue (`true`: a session ended on a confirm that
    /// did not come in time, on a connection the broker does not block) or that one came. Each
    /// reconnect opens a connection and declares its topology as if all were well, so its
    /// session's flag alone would read ready again between the deadlines. Logged when it changes.
    pub fn set_overdue(&self, name: &str, overdue: bool) {
        let mut links = self.overdue.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if overdue && !links.contains_key(name) {
            tracing::warn!(what = name, "confirms overdue: not ready until the broker confirms again");
            links.insert(name.to_owned(), chrono::Utc::now());
        } else if !overdue && let Some(since) = links.remove(name) {
            tracing::info!(what = name, %since, "the broker confirms again");
        }
    }

    /// The links whose confirms are overdue, and since when.
    pub fn overdue(&self) -> BTreeMap<String, chrono::DateTime<chrono::Utc>> {
        self.overdue.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone()
    }

    /// The flags that are not ready, and the links whose confirms are overdue.
    pub fn failing(&self) -> Vec<String> {
        self.failing_since().into_keys().collect()
    }

    /// Every check known: since when it has failed, or `None` while it passes. A flag not ready
    /// fails since it was set so; a link whose confirms are overdue, since they were (the earlier
    /// of the two).
    pub fn checks(&self) -> BTreeMap<String, Option<chrono::DateTime<chrono::Utc>>> {
        let flags = self.flags.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut checks: BTreeMap<String, Option<chrono::DateTime<chrono::Utc>>> =
            flags.iter().map(|(name, (ready, since))| (name.clone(), (!ready).then_some(*since))).collect();
        drop(flags);
        for (name, overdue) in self.overdue() {
            let since = checks.entry(name).or_default();
            *since = Some(since.map_or(overdue, |since| since.min(overdue)));
        }
        checks
    }

    /// The checks that fail, and since when.
    pub fn failing_since(&self) -> BTreeMap<String, chrono::DateTime<chrono::Utc>> {
        self.checks().into_iter().filter_map(|(name, since)| Some((name, since?))).collect()
    }
}

/// Whether readiness check `name` is about a broker session or link (a consumer's, its probe's,
/// a relay loop's), the checks a [`Health::broker_reported_only`] service reports without failing
/// on them. Named, so that any other check a service adds fails its readiness.
fn is_broker_check(name: &str) -> bool {
    name.starts_with("consumer:") || name.starts_with("relay:")
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
    /// Whether `/readyz` leaves the broker's sessions out of its verdict, only reporting them
    /// (`brokerFailing`, `readiness_failing_seconds`): for a service that does its work without the
    /// broker, the API, which a load balancer must not take out while the broker is away.
    pub broker_reported_only: bool,
}

/// Liveness: the process runs.
pub const HEALTHZ: &str = "/healthz";
/// Readiness, with what fails.
pub const READYZ: &str = "/readyz";
/// The metrics, for Prometheus.
pub const METRICS: &str = "/metrics";

/// Whether `path` is one of the three health routes, which every service serves beside its own.
pub fn is_health_route(path: &str) -> bool {
    matches!(path, HEALTHZ | READYZ | METRICS)
}

/// The three health routes.
pub fn routes(health: Health) -> Router {
    Router::new()
        .route(HEALTHZ, get(|| async { Json(serde_json::json!({ "status": "ok" })) }))
        .route(READYZ, get(readyz))
        .route(METRICS, get(metrics))
        .with_state(health)
}

/// Ask each database whether it takes writes, all at once (2 s at most), and set its check
/// (`database:<name>`): on each probe of `/readyz` and each scrape of `/metrics`, so that neither
/// reports a stale verdict.
async fn check_databases(health: &Health) {
    let checks = health
        .databases
        .iter()
        .map(|(name, pool)| async move { (format!("database:{name}"), crate::runtime::db::takes_writes(pool).await) });
    for (check, takes_writes) in futures_util::future::join_all(checks).await {
        health.readiness.set(&check, takes_writes);
    }
}

async fn readyz(State(health): State<Health>) -> impl IntoResponse {
    check_databases(&health).await;
    let (failing, broker_failing): (Vec<String>, Vec<String>) =
        health.readiness.failing().into_iter().partition(|name| !health.broker_reported_only || !is_broker_check(name));
    let status = if failing.is_empty() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    // A blocked connection is reported, not failed: a consumer on it still acks (on its own
    // connection), an API still takes orders; the outbox age and the blocked gauge page.
    let blocked: BTreeMap<String, Blocked> =
        health.readiness.blocked().into_iter().filter_map(|(name, blocked)| Some((name, blocked?))).collect();
    let body = serde_json::json!({
        "status": if failing.is_empty() { "ready" } else { "not ready" },
        "failing": failing,
        // Broker sessions that fail without failing readiness (`broker_reported_only`).
        "brokerFailing": broker_failing,
        "brokerNodes": health.readiness.nodes(),
        "blockedConnections": blocked,
        "overdueConfirms": health.readiness.overdue(),
    });
    (status, Json(body))
}

async fn metrics(State(health): State<Health>) -> impl IntoResponse {
    // The outbox gauges are read at scrape time. A database that is down loses its gauges (they
    // would be stale); the counters and histograms still render.
    check_databases(&health).await;
    let metrics = &health.metrics;
    let now = chrono::Utc::now();
    for (name, blocked) in health.readiness.blocked() {
        let seconds = blocked.map_or(0.0, |blocked| (now - blocked.since).to_std().unwrap_or_default().as_secs_f64());
        metrics.connection_blocked.get_or_create(&metrics::ByConnection { connection: name }).set(seconds);
    }
    for (check, since) in health.readiness.checks() {
        let seconds = since.map_or(0.0, |since| (now - since).to_std().unwrap_or_default().as_secs_f64());
        metrics.readiness_failing.get_or_create(&metrics::ByCheck { check }).set(seconds);
    }
    for (name, pool) in &health.databases {
        let database = ByDatabase { database: name.clone() };
        let by_state = |state: &str| ByDatabaseState { database: name.clone(), state: state.to_owned() };
        match tokio::time::timeout(Duration::from_secs(2), outbox::gauges(pool)).await {
            Ok(Ok(gauges)) => {
                let rows =
                    [("unpublished", gauges.unpublished), ("parked", gauges.parked), ("scheduled", gauges.scheduled)];
                for (state, rows) in rows {
                    metrics.outbox_rows.get_or_create(&by_state(state)).set(rows);
                }
                metrics.oldest_unpublished.get_or_create(&database).set(gauges.oldest_unpublished_age_seconds);
            }
            _ => {
                metrics.outbox_rows.remove(&by_state("unpublished"));
                metrics.outbox_rows.remove(&by_state("parked"));
                metrics.outbox_rows.remove(&by_state("scheduled"));
                metrics.oldest_unpublished.remove(&database);
            }
        }
    }
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], metrics.render())
}

/// Serve `router` on `listener` until shutdown, then finish in-flight requests.
pub async fn serve(listener: tokio::net::TcpListener, router: Router, shutdown: Shutdown) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(async move { shutdown.triggered().await }).await
}

#[cfg(test)]
mod tests {
    use super::Readiness;

    #[test]
    fn a_link_whose_confirms_are_overdue_fails_though_its_session_is_up_until_a_confirm_comes() {
        let readiness = Readiness::default();
        readiness.set("relay:orders", true);
        readiness.set_overdue("relay:orders", true);
        // A reconnect sets the session's flag again; the overdue confirm still fails it.
        readiness.set("relay:orders", true);
        assert_eq!(readiness.failing(), ["relay:orders"]);
        let since = readiness.overdue()["relay:orders"];
        readiness.set_overdue("relay:orders", true);
        assert_eq!(readiness.overdue()["relay:orders"], since, "overdue since the first time");
        readiness.set("relay:orders", false);
        assert_eq!(readiness.failing(), ["relay:orders"], "named once");
        readiness.set("relay:orders", true);
        readiness.set_overdue("relay:orders", false);
        assert!(readiness.failing().is_empty());
        assert!(readiness.overdue().is_empty());
    }

    #[test]
    fn a_check_fails_since_it_last_turned_and_an_overdue_link_since_the_earlier_of_the_two() {
        let pause = || std::thread::sleep(std::time::Duration::from_millis(5));
        let readiness = Readiness::default();
        readiness.set("consumer:orders.status", false);
        let since = readiness.failing_since()["consumer:orders.status"];
        pause();
        readiness.set("consumer:orders.status", false);
        assert_eq!(readiness.failing_since()["consumer:orders.status"], since, "still failing since then");
        pause();
        readiness.set_overdue("consumer:orders.status", true);
        assert_eq!(readiness.failing_since()["consumer:orders.status"], since, "the earlier: the flag's");
        // Overdue first, then the flag: the overdue link's time.
        readiness.set_overdue("relay:orders", true);
        let overdue = readiness.overdue()["relay:orders"];
        pause();
        readiness.set("relay:orders", false);
        assert_eq!(readiness.failing_since()["relay:orders"], overdue, "the earlier: the link's");
        // Ready again while overdue: still failing, since the link went overdue.
        readiness.set("relay:orders", true);
        assert_eq!(readiness.checks()["relay:orders"], Some(overdue));
        readiness.set_overdue("relay:orders", false);
        assert_eq!(readiness.checks()["relay:orders"], None);
        readiness.set_overdue("consumer:orders.status", false);
        readiness.set("consumer:orders.status", true);
        readiness.set("database:orders", true);
        let checks = readiness.checks();
        assert_eq!(checks.len(), 3);
        assert!(checks.values().all(Option::is_none), "{checks:?}");
    }
}
