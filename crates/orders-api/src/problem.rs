//! The one error type at the HTTP edge: every failure becomes an RFC 9457 `application/problem+json`
//! response ([`Problem`], the runtime's, which every service's routes answer with) with a precise
//! status, and no database text ever reaches the client. Server-side failures are logged once, by
//! the `log_failures` middleware, not here.

use std::sync::Arc;

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
pub use messaging::runtime::problem::Problem;
use messaging::{outage, runtime::problem, service::BoxError};

use crate::place::WriteError;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed or invalid input (400).
    #[error("{0}")]
    BadRequest(String),
    /// Not `application/json` (415).
    #[error("expected Content-Type: application/json")]
    UnsupportedMediaType,
    /// Body over the limit (413).
    #[error("request body exceeds {0} bytes")]
    PayloadTooLarge(usize),
    /// The order's `order.placed` would be over `MAX_MESSAGE_BYTES` (413).
    #[error(
        "the order's message would be {size} bytes, over the {limit}-byte limit (MAX_MESSAGE_BYTES): split the order"
    )]
    MessageTooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// No bearer token, or one that is refused (401, with `WWW-Authenticate: Bearer`): why, if
    /// there was a token.
    #[error("{}", .0.as_deref().unwrap_or("this route needs `Authorization: Bearer <token>`"))]
    Unauthenticated(Option<String>),
    /// The token's caller may not do this (403).
    #[error("{0}")]
    Forbidden(String),
    /// No such resource (404).
    #[error("{0}")]
    NotFound(String),
    /// The resource's state forbids the request: an order that has ended cannot be cancelled (409).
    #[error("{0}")]
    Conflict(String),
    /// Idempotency key reused with a different request (422).
    #[error("Idempotency-Key was already used with a different request body")]
    IdempotencyMismatch,
    /// The database is unreachable, or the request's statement lost to other work (a lock or the
    /// statement past its timeout, a deadlock: [`outage::lost_to_other_work`]), nothing written:
    /// try again later (503).
    #[error("{}", problem::RETRY_LATER)]
    Unavailable(#[source] BoxError),
    /// The broker or its management API refused or failed what an operator asked of the console
    /// (502), in msgctl's words: shown, since only operators reach it.
    #[error("{0}")]
    BadGateway(String),
    /// The broker did not finish what an operator asked of the console in time (504): what it
    /// did, and whether it goes on.
    #[error("{0}")]
    GatewayTimeout(String),
    /// Anything else (500): details are logged, never returned.
    #[error("{}", problem::INTERNAL)]
    Internal(#[source] BoxError),
}

impl ApiError {
    /// A 500 caused by `cause`.
    pub fn internal(cause: impl Into<BoxError>) -> Self {
        Self::Internal(cause.into())
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        if outage::retry_later(&error) { Self::Unavailable(error.into()) } else { Self::internal(error) }
    }
}

impl From<WriteError> for ApiError {
    fn from(error: WriteError) -> Self {
        if error.retry_later() { Self::Unavailable(error.into()) } else { Self::internal(error) }
    }
}

/// Attached to 5xx responses so the logging middleware can log the cause once.
#[derive(Debug, Clone)]
pub struct FailureCause(pub Arc<String>);

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::PayloadTooLarge(_) | Self::MessageTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::IdempotencyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::BadGateway(_) => StatusCode::BAD_GATEWAY,
            Self::GatewayTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // `application/problem+json`, and `Retry-After` on a 503.
        let mut response = Problem::new(self.status(), self.to_string()).into_response();
        if let Self::Unavailable(cause) | Self::Internal(cause) = &self {
            response.extensions_mut().insert(FailureCause(Arc::new(cause.to_string())));
        }
        if let Self::BadGateway(cause) | Self::GatewayTimeout(cause) = &self {
            response.extensions_mut().insert(FailureCause(Arc::new(cause.clone())));
        }
        if let Self::Unauthenticated(refused) = &self {
            // RFC 6750, 3: a refused token is an `invalid_token`; no token gets the bare challenge.
            let challenge = match refused {
                Some(_) => HeaderValue::from_static(r#"Bearer realm="orders", error="invalid_token""#),
                None => HeaderValue::from_static(r#"Bearer realm="orders""#),
            };
            response.headers_mut().insert(header::WWW_AUTHENTICATE, challenge);
        }
        response
    }
}

/// Middleware: log the cause of every 5xx once.
pub async fn log_failures(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let response = next.run(request).await;
    if let Some(FailureCause(cause)) = response.extensions().get::<FailureCause>() {
        tracing::error!(%method, %path, status = response.status().as_u16(), cause = %cause, "request failed");
    }
    response
}
