//! `http_responses_total{class}`: the API's answers by status class, counted by a middleware
//! around its routes (not the health routes), so that a rate of 5xx pages (alert `ApiErrorRate`)
//! where the API is ready but failing, as when its database's disk is full: every order answers
//! 503 while `/readyz` stays 200. The server's own 503, a request past `HTTP_REQUEST_TIMEOUT`
//! (`messaging::runtime::serve`), is answered outside this layer, which sees its work dropped
//! unanswered: the server counts it apart, `http_request_timeouts_total`, and `ApiErrorRate`
//! adds the two. The API's own deadlines (the pool's 2 s, `QUERY_DEADLINE`) usually answer first.

use axum::{extract::State, response::Response};
use prometheus_client::metrics::{counter::Counter, family::Family};

/// The status classes counted, each exported from the start (at 0), so that a rate of each
/// exists before the first such answer.
const CLASSES: [&str; 4] = ["2xx", "3xx", "4xx", "5xx"];

/// The counter, by class.
#[derive(Debug, Clone)]
pub struct ResponseMetrics {
    responses: Family<[(&'static str, &'static str); 1], Counter>,
}

impl ResponseMetrics {
    /// Register `http_responses_total` beside the runtime's metrics.
    pub fn register(metrics: &mut messaging::runtime::metrics::Metrics) -> Self {
        let responses = Family::default();
        metrics.register(
            "http_responses",
            "The API's answers (its own routes, not /healthz, /readyz or /metrics), by status class",
            responses.clone(),
        );
        for class in CLASSES {
            let _ = responses.get_or_create(&[("class", class)]);
        }
        Self { responses }
    }
}

/// Middleware: count each answer by its status class.
pub async fn count(
    State(metrics): State<ResponseMetrics>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let response = next.run(request).await;
    let class = match response.status().as_u16() {
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => return response,
    };
    metrics.responses.get_or_create(&[("class", class)]).inc();
    response
}
