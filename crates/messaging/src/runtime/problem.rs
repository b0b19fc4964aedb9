//! The one shape of a failed request at every service's HTTP edge: an RFC 9457
//! `application/problem+json` document with a precise status, and never a database's own words.
//! The orders API renders its errors as a [`Problem`]; a service's own routes
//! (`examples/shipping`'s) return one, made from a database error by [`Problem::from_database`].

use axum::{
    Json,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde::Serialize;

use crate::outage;

/// The `detail` of a 503 for a database that cannot serve the request now.
pub const RETRY_LATER: &str = "service temporarily unavailable, retry later";

/// The `detail` of a 500: what went wrong is logged, never returned.
pub const INTERNAL: &str = "internal error";

/// An RFC 9457 problem document (`application/problem+json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Problem {
    /// Always `about:blank`: the status says what kind of problem it is.
    #[serde(rename = "type")]
    kind: &'static str,
    /// The status's reason phrase, e.g. `Bad Request`.
    title: &'static str,
    /// The HTTP status.
    status: u16,
    /// What exactly was wrong, for people.
    detail: String,
}

impl Problem {
    /// A problem with `status`, described by `detail`.
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self {
            kind: "about:blank",
            title: status.canonical_reason().unwrap_or("Error"),
            status: status.as_u16(),
            detail: detail.into(),
        }
    }

    /// What a route's database `error` means to its client: 503 (with `Retry-After`) if the
    /// database cannot serve it now, unreachable or busy ([`outage::is_unreachable`],
    /// [`outage::lost_to_other_work`]), nothing written; else 500. Either way the cause is logged
    /// here, once, and not returned.
    pub fn from_database(error: sqlx::Error) -> Self {
        if outage::retry_later(&error) {
            tracing::warn!(%error, "request refused: the database cannot serve it now");
            Self::new(StatusCode::SERVICE_UNAVAILABLE, RETRY_LATER)
        } else {
            tracing::error!(%error, "request failed");
            Self::new(StatusCode::INTERNAL_SERVER_ERROR, INTERNAL)
        }
    }

    /// Its status.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl IntoResponse for Problem {
    /// The document, typed `application/problem+json`; a 503 says when to retry (`Retry-After`).
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, Json(self)).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_is_typed_and_a_503_says_when_to_retry() {
        let response = Problem::new(StatusCode::NOT_FOUND, "no such thing").into_response();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        let unreachable = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused"));
        let response = Problem::from_database(unreachable).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        let verdict = Problem::from_database(sqlx::Error::RowNotFound);
        assert_eq!(verdict, Problem::new(StatusCode::INTERNAL_SERVER_ERROR, INTERNAL));
    }
}
