//! The live page (`GET /`) and its data (`GET /overview`): the shop as an operator would watch it.
//! Recent jobs and the quarantined ones come from this service's own database; per-endpoint
//! counts and the outbox backlog from every service's `/metrics` (`SHOP_METRICS_URLS`, this
//! service's own counters included); parking depths from the RabbitMQ management API
//! (`RABBITMQ_MANAGEMENT_URL`). A source that does not answer leaves its part empty (and says so in
//! `unavailable`): the page is for watching, never a reason for the API to fail.

use std::{collections::BTreeMap, time::Duration};

use axum::{Json, Router, extract::State, response::Html, routing::get};
use chrono::{DateTime, Utc};
use messaging::runtime::{config::SecretUrl, health::Health};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

use crate::{
    auth::{Auth, Caller},
    problem::ApiError,
};

/// Where the page's data comes from besides this service's database, and who may read it.
#[derive(Clone)]
pub struct Sources {
    pool: PgPool,
    health: Health,
    metrics: Vec<String>,
    management: Option<(SecretUrl, String)>,
    auth: Auth,
    console: Option<crate::console::Console>,
}

impl axum::extract::FromRef<Sources> for Auth {
    fn from_ref(sources: &Sources) -> Self {
        sources.auth.clone()
    }
}

impl Sources {
    /// The page's sources: this service's pool and health, the other services' `/metrics` URLs,
    /// and the RabbitMQ management API (`http://user:password@host:port`), if any, with the path
    /// of the service's vhost's queues (`BrokerNodes::management_queues_path`); its data is for
    /// the operators `auth` accepts.
    pub fn new(
        pool: PgPool,
        health: Health,
        metrics: Vec<String>,
        management: Option<(SecretUrl, String)>,
        auth: Auth,
    ) -> Self {
        Self { pool, health, metrics, management, auth, console: None }
    }

    /// With the console of parked messages (`/parked`), which is off without one.
    pub fn with_console(self, console: Option<crate::console::Console>) -> Self {
        Self { console, ..self }
    }

    /// `GET url` (basic auth from its user info; `https://` as [`messaging::runtime::http`] does it), its
    /// body as text, within two seconds.
    async fn get(&self, url: &str) -> Result<String, String> {
        let response =
            tokio::time::timeout(Duration::from_secs(2), messaging::runtime::http::request("GET", url, &[], None))
                .await
                .map_err(|_| "no answer within 2 s".to_owned())?
                .map_err(|error| error.to_string())?;
        if !(200..300).contains(&response.status) {
            return Err(format!("status {}", response.status));
        }
        String::from_utf8(response.body).map_err(|error| error.to_string())
    }
}

/// `GET /` and `GET /overview`.
pub fn routes(sources: Sources) -> Router {
    let console = crate::console::routes(sources.console.clone(), sources.auth.clone());
    Router::new()
        .route("/", get(|| async { Html(include_str!("page.html")) }))
        .route("/overview", get(overview))
        .with_state(sources)
        .merge(console)
}

/// What `GET /overview` answers.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Overview {
    /// The latest jobs, newest first.
    pub jobs: Vec<JobRow>,
    /// Messages handled per consuming endpoint, by outcome.
    pub endpoints: Vec<EndpointCounts>,
    /// Each outbox: rows waiting, and how long the oldest has waited.
    pub outboxes: Vec<OutboxBacklog>,
    /// Messages in each parking queue.
    pub parking: Vec<ParkingQueue>,
    /// The latest quarantined jobs, with the reason their message was parked.
    pub quarantined: Vec<JobRow>,
    /// Sources that did not answer.
    pub unavailable: Vec<String>,
}

/// A job, as the page lists it.
#[derive(Debug, Serialize, sqlx::FromRow, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct JobRow {
    /// The job.
    pub job_id: Uuid,
    /// Its order (the page's cancel button posts to `/orders/{orderId}/cancel`).
    pub order_id: Uuid,
    /// What was ordered, e.g. `2 × SKU-1`.
    pub lines: String,
    /// Its state.
    pub state: String,
    /// The highest attempt any step needed.
    pub attempt: i32,
    /// Why it was rejected, declined, cancelled or quarantined.
    pub last_error: Option<String>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// Deliveries handled by one endpoint, by outcome.
#[derive(Debug, Default, Serialize, utoipa::ToSchema)]
pub struct EndpointCounts {
    /// e.g. `inventory.order-placed`.
    pub endpoint: String,
    /// Applied and acked.
    pub succeeded: u64,
    /// Sent to a wait queue for another attempt.
    pub retried: u64,
    /// Sent to parking.
    pub parked: u64,
    /// Skipped by the inbox.
    pub duplicate: u64,
}

/// One outbox's backlog.
#[derive(Debug, Default, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutboxBacklog {
    /// Its database.
    pub database: String,
    /// Rows not yet published.
    pub unpublished: f64,
    /// Seconds the oldest of them has waited.
    pub oldest_unpublished_age_seconds: f64,
}

/// One parking queue.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ParkingQueue {
    /// `<endpoint>.parking`.
    pub queue: String,
    /// Messages in it.
    pub messages: u64,
}

async fn overview(State(sources): State<Sources>, caller: Caller) -> Result<Json<Overview>, ApiError> {
    // Order ids and what the broker holds: an operator's to read.
    caller.operator("the live page's data")?;
    let jobs = recent_jobs(&sources.pool, false).await?;
    let quarantined = recent_jobs(&sources.pool, true).await?;
    let mut unavailable = Vec::new();

    let mut samples = Vec::new();
    samples.extend(parse_samples(&sources.health.metrics.render()));
    for url in &sources.metrics {
        match sources.get(url).await {
            Ok(text) => samples.extend(parse_samples(&text)),
            Err(error) => unavailable.push(format!("{url}: {error}")),
        }
    }
    let mut parking = Vec::new();
    if let Some((management, queues)) = &sources.management {
        let url = messaging::runtime::http::join(management.expose(), &format!("{queues}?columns=name,messages"));
        match sources
            .get(&url)
            .await
            .and_then(|body| serde_json::from_str::<serde_json::Value>(&body).map_err(|e| e.to_string()))
        {
            Ok(queues) => {
                for queue in queues.as_array().into_iter().flatten() {
                    let name = queue["name"].as_str().unwrap_or_default();
                    if name.ends_with(".parking") {
                        let messages = queue["messages"].as_u64().unwrap_or(0);
                        parking.push(ParkingQueue { queue: name.to_owned(), messages });
                    }
                }
            }
            Err(error) => unavailable.push(format!("RabbitMQ management API: {error}")),
        }
    }
    Ok(Json(Overview {
        jobs,
        endpoints: endpoint_counts(&samples),
        outboxes: outbox_backlogs(&samples),
        parking,
        quarantined,
        unavailable,
    }))
}

/// The 20 latest jobs, or the 20 latest quarantined ones.
async fn recent_jobs(pool: &PgPool, quarantined_only: bool) -> Result<Vec<JobRow>, ApiError> {
    let rows = sqlx::query_as(
        "select j.id as job_id, j.order_id, j.state, j.attempt, j.last_error, j.updated_at,
                coalesce((select string_agg(l.quantity || ' × ' || l.sku, ', ' order by l.line_no)
                            from order_lines l where l.order_id = j.order_id), '') as lines
           from jobs j where not $1 or j.state = 'quarantined' order by j.created_at desc limit 20",
    )
    .bind(quarantined_only)
    .fetch_all(pool);
    Ok(messaging::runtime::db::within(messaging::runtime::db::QUERY_DEADLINE, rows).await?)
}

/// A sample of the Prometheus text format: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

/// The samples of a Prometheus text exposition (our own metrics: no escaped quotes in labels).
fn parse_samples(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines().filter(|line| !line.starts_with('#') && !line.trim().is_empty()) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels = labels
            .split(',')
            .filter_map(|pair| pair.split_once('='))
            .map(|(key, value)| (key.to_owned(), value.trim_matches('"').to_owned()))
            .collect();
        samples.push((name.to_owned(), labels, value));
    }
    samples
}

fn endpoint_counts(samples: &[Sample]) -> Vec<EndpointCounts> {
    let mut counts: BTreeMap<String, EndpointCounts> = BTreeMap::new();
    for (name, labels, value) in samples {
        if name != messaging::runtime::metrics::MESSAGES_HANDLED {
            continue;
        }
        let Some(endpoint) = labels.get("endpoint") else { continue };
        let entry = counts
            .entry(endpoint.clone())
            .or_insert_with(|| EndpointCounts { endpoint: endpoint.clone(), ..EndpointCounts::default() });
        let count = *value as u64;
        match labels.get("outcome").map(String::as_str) {
            Some("succeeded") => entry.succeeded += count,
            Some("retried") => entry.retried += count,
            Some("parked") => entry.parked += count,
            Some("duplicate") => entry.duplicate += count,
            _ => {}
        }
    }
    counts.into_values().collect()
}

/// Per database, the largest figure any service reports (each service and the relay report the
/// same outbox).
fn outbox_backlogs(samples: &[Sample]) -> Vec<OutboxBacklog> {
    let mut backlogs: BTreeMap<String, OutboxBacklog> = BTreeMap::new();
    for (name, labels, value) in samples {
        let Some(database) = labels.get("database") else { continue };
        let entry = backlogs
            .entry(database.clone())
            .or_insert_with(|| OutboxBacklog { database: database.clone(), ..OutboxBacklog::default() });
        match name.as_str() {
            "outbox_rows" if labels.get("state").map(String::as_str) == Some("unpublished") => {
                entry.unpublished = entry.unpublished.max(*value);
            }
            "outbox_oldest_unpublished_age_seconds" => {
                entry.oldest_unpublished_age_seconds = entry.oldest_unpublished_age_seconds.max(*value);
            }
            _ => {}
        }
    }
    backlogs.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_become_endpoint_counts_and_outbox_backlogs() {
        let text = "# HELP x\nmessages_handled_total{endpoint=\"a\",outcome=\"succeeded\"} 3\n\
                    messages_handled_total{endpoint=\"a\",outcome=\"parked\"} 1\n\
                    outbox_rows{database=\"orders\",state=\"unpublished\"} 2\n\
                    outbox_oldest_unpublished_age_seconds{database=\"orders\"} 1.5\n";
        let samples = parse_samples(text);
        let counts = endpoint_counts(&samples);
        assert_eq!((counts[0].endpoint.as_str(), counts[0].succeeded, counts[0].parked), ("a", 3, 1));
        let backlogs = outbox_backlogs(&samples);
        assert_eq!(backlogs[0].database, "orders");
        assert_eq!((backlogs[0].unpublished, backlogs[0].oldest_unpublished_age_seconds), (2.0, 1.5));
    }
}
