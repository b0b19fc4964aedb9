//! The HTTP API (the README's "HTTP API", `docs/openapi.json`): accept orders, report jobs and
//! orders.

use axum::{
    Extension, Json, Router,
    body::{Body, Bytes},
    extract::{FromRef, Path, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use chrono::{DateTime, Utc};
use messaging::{
    envelope::HEADER_TRACEPARENT as TRACEPARENT,
    outbox,
    runtime::db::{self, QUERY_DEADLINE},
    trace::{self, TraceContext},
};
use serde::{Deserialize, Serialize};
use shop::OrderLine;
use sqlx::PgPool;
use tracing::Instrument;
use uuid::Uuid;

use crate::{
    auth::{Auth, Caller},
    jobs,
    order::{Accepted, CustomerId, IdempotencyKey, Line, OrderStatus, Quantity, Sku, ValidOrder},
    place::{Claim, NewOrder, Writer},
    problem::{ApiError, Problem},
    story,
};

/// The span of a `POST` to `route` that starts a trace (W3C trace context, `messaging::trace`),
/// named `name`; [`traced`] gives it the trace's ids, under which it is exported if `OTEL_*` names
/// a collector.
macro_rules! request_span {
    ($name:literal, $route:literal) => {
        tracing::info_span!(
            $name,
            otel.kind = "server",
            otel.status_code = tracing::field::Empty,
            http.request.method = "POST",
            http.route = $route,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            parent_id = tracing::field::Empty,
            sampled = tracing::field::Empty,
        )
    };
}

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// What the API refuses beyond an invalid request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest `order.placed` body an order may make (`MAX_MESSAGE_BYTES`). The broker refuses
    /// a message over its `max_message_size` (16 MiB by default on 4.x), and an order whose message
    /// it refuses could never proceed: it is refused here, with 413, before anything is written.
    pub max_message_bytes: usize,
    /// How long an order may take (`ORDER_DEADLINE`): one that has not ended by then is cancelled,
    /// and what it took is given back.
    pub order_deadline: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_message_bytes: 1024 * 1024, order_deadline: std::time::Duration::from_secs(30 * 60) }
    }
}

/// The API's routes: reads on `pool`, orders written by `writer`, within `limits`, changes only
/// for callers `auth` accepts.
pub fn router(pool: PgPool, writer: Writer, limits: Limits, auth: Auth) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{order_id}", get(get_order))
        .route("/orders/{order_id}/cancel", post(cancel_order))
        .route("/jobs/{job_id}", get(get_job))
        .route("/jobs/{job_id}/events", get(get_job_events))
        .with_state(ApiState { pool, writer, limits, auth })
}

/// What the handlers share.
#[derive(Debug, Clone)]
pub(crate) struct ApiState {
    pool: PgPool,
    writer: Writer,
    limits: Limits,
    auth: Auth,
}

impl FromRef<ApiState> for PgPool {
    fn from_ref(state: &ApiState) -> Self {
        state.pool.clone()
    }
}

impl FromRef<ApiState> for Auth {
    fn from_ref(state: &ApiState) -> Self {
        state.auth.clone()
    }
}

/// `POST /orders` body. Unknown fields are refused: a typo must not silently drop data.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PlaceOrder {
    /// Who orders: 1 to 200 characters, not all blank, no control characters. The bearer token's
    /// customer (`sub`), unless an operator's token places the order.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]*\\S[^\\u0000-\\u001f\\u007f-\\u009f]*$"
    )]
    pub customer_id: String,
    /// What: 1 to 100 lines.
    #[schema(min_items = 1, max_items = 100)]
    pub lines: Vec<OrderLineRequest>,
}

/// One requested line.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OrderLineRequest {
    /// Stock keeping unit: 1 to 200 characters, not all blank, no control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = "^[^\\u0000-\\u001f\\u007f-\\u009f]*\\S[^\\u0000-\\u001f\\u007f-\\u009f]*$"
    )]
    pub sku: String,
    /// How many: 1 to 1000.
    #[schema(minimum = 1, maximum = 1000)]
    #[serde(deserialize_with = "whole_number")]
    pub quantity: i32,
}

impl PlaceOrder {
    /// The order this request asks for, if every part of it is valid; else a 400 naming the first
    /// part that is not (`lines[2].sku must be …`): the customer, each line, then their number.
    pub fn parse(&self) -> Result<ValidOrder, ApiError> {
        // The field's name is written only for a refusal.
        let bad = |field: std::fmt::Arguments<'_>, invalid| ApiError::BadRequest(format!("{field} {invalid}"));
        let customer_id =
            CustomerId::parse(self.customer_id.clone()).map_err(|invalid| bad(format_args!("customerId"), invalid))?;
        let lines = self
            .lines
            .iter()
            .enumerate()
            .map(|(i, line)| {
                Ok(Line {
                    sku: Sku::parse(line.sku.clone())
                        .map_err(|invalid| bad(format_args!("lines[{i}].sku"), invalid))?,
                    quantity: Quantity::parse(line.quantity)
                        .map_err(|invalid| bad(format_args!("lines[{i}].quantity"), invalid))?,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        ValidOrder::new(customer_id, lines).map_err(|invalid| ApiError::BadRequest(invalid.to_string()))
    }
}

/// A JSON integer, written `3` or `3.0` (both are the integer 3 to JSON Schema, and so to clients
/// generated from the OpenAPI document); anything else is refused.
fn whole_number<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<i32, D::Error> {
    let number = serde_json::Number::deserialize(deserializer)?;
    let whole =
        number.as_i64().or_else(|| number.as_f64().filter(|n| n.fract() == 0.0 && n.abs() < 1e15).map(|n| n as i64));
    whole
        .and_then(|n| i32::try_from(n).ok())
        .ok_or_else(|| serde::de::Error::custom(format!("expected a whole number, got {number}")))
}

/// Accept an order: the order, its lines, its job and its `order.placed` message are written in
/// one transaction, all or nothing. The caller's bearer token names the customer (`sub`); an
/// operator's token may order for anyone.
#[utoipa::path(
    post,
    path = "/orders",
    tag = "orders",
    security(("bearer" = [])),
    request_body(content = PlaceOrder, content_type = "application/json"),
    params(
        ("Idempotency-Key" = Option<String>, Header, pattern = "^[!-~]{1,255}$",
         description = "Retries with the same key and body get the same job; another body gets 422."),
        ("traceparent" = Option<String>, Header, description = "W3C trace context to continue."),
    ),
    responses(
        (status = 202, description = "Accepted: poll the job.", body = Accepted,
         headers(("Location" = String, description = "`/jobs/{jobId}`"))),
        (status = 400, description = "Malformed or invalid input: nothing was written.", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No bearer token, or one refused (forged, expired, another key): nothing was written.", body = Problem, content_type = "application/problem+json",
         headers(("WWW-Authenticate" = String, description = "`Bearer realm=\"orders\"`"))),
        (status = 403, description = "The token's customer is not the order's `customerId`: nothing was written.", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body over 64 KiB, or an order whose messages (its `order.placed`, its `inventory.reserved`) would be over `MAX_MESSAGE_BYTES`: nothing was written.", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Not `application/json`: nothing was written.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "The Idempotency-Key was used with another body.", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The database is unreachable, or busy (a lock or a statement past its timeout, a deadlock): nothing was written; retry later.", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = String, description = "Seconds"))),
    )
)]
pub(crate) async fn place_order(
    State(ApiState { pool, writer, limits, .. }): State<ApiState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let request = read_json::<PlaceOrder>(&headers, body).await?;
    let order = request.parse()?;
    if !caller.acts_for(&request.customer_id) {
        return Err(ApiError::Forbidden(format!(
            "the bearer token is customer {:?}'s: it may not order in {:?}'s name",
            caller.name(),
            request.customer_id
        )));
    }
    // Its ids do not change its size: every UUID is written with the same length.
    let placeholder = Accepted { job_id: Uuid::nil(), order_id: Uuid::nil() };
    // In microseconds, as Postgres keeps it: the row's due time and order.placed's say the same.
    let deadline = chrono::SubsecRound::trunc_subsecs(
        chrono::Utc::now() + chrono::TimeDelta::from_std(limits.order_deadline).map_err(ApiError::internal)?,
        6,
    );
    // The largest message the order causes: its `order.placed`, or inventory's `inventory.reserved`,
    // which carries the same lines and a reservation id in place of the customer's. Refused
    // downstream, it would leave the order quarantined after it was accepted.
    let placed = order.placed(&placeholder, deadline);
    let reserved = shop::InventoryReserved {
        order_id: placed.order_id,
        job_id: placed.job_id,
        reservation_id: Uuid::nil(),
        lines: placed.lines.clone(),
        deadline: placed.deadline,
    };
    let message_bytes = outbox::published_size(&placed)
        .and_then(|placed| Ok(placed.max(outbox::published_size(&reserved)?)))
        .map_err(ApiError::internal)?;
    if message_bytes > limits.max_message_bytes {
        return Err(ApiError::MessageTooLarge { size: message_bytes, limit: limits.max_message_bytes });
    }
    let claim = match idempotency_key(&headers)? {
        // The request as parsed, to tell a retry (the same body) from another use of the key.
        Some(key) => Some(Claim { key, request: serde_json::to_value(&request).map_err(ApiError::internal)? }),
        None => None,
    };
    // The request starts the order's trace, or continues the caller's: the `order.placed` row
    // names this request's span as its parent. Bounded: a silent (black-holed) connection answers
    // 503 after the deadline instead of holding the request for the kernel's TCP timeout.
    let span = request_span!("POST /orders", "/orders");
    let accepted = db::within(QUERY_DEADLINE, accept(&pool, &writer, &order, claim, deadline));
    let accepted = traced(&headers, span, accepted).await?;
    let location = format!("/jobs/{}", accepted.job_id);
    Ok((StatusCode::ACCEPTED, [(header::LOCATION, location)], Json(accepted)).into_response())
}

/// Run `work` in `span`, as the current trace context: the caller's `traceparent` continued, or a
/// new trace. What `work` writes to the outbox names the span as its parent; a failure marks it.
async fn traced<T>(
    headers: &HeaderMap,
    span: tracing::Span,
    work: impl Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    let context = TraceContext::continuing(headers.get(TRACEPARENT).and_then(|value| value.to_str().ok()));
    context.record_on(&span);
    trace::scope(context, work.instrument(span.clone())).await.inspect_err(|_| {
        span.record("otel.status_code", "error");
    })
}

/// Check the content type, read at most [`MAX_BODY_BYTES`], parse.
pub(crate) async fn read_json<T: serde::de::DeserializeOwned>(headers: &HeaderMap, body: Body) -> Result<T, ApiError> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("application/json") {
        return Err(ApiError::UnsupportedMediaType);
    }
    let bytes: Bytes =
        axum::body::to_bytes(body, MAX_BODY_BYTES).await.map_err(|_| ApiError::PayloadTooLarge(MAX_BODY_BYTES))?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, ApiError> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    // A header that is not even text fails as an empty one does.
    let key = IdempotencyKey::parse(value.to_str().unwrap_or_default());
    key.map(Some).map_err(|invalid| ApiError::BadRequest(invalid.to_string()))
}

/// Write the order, its lines, its job, its outbox rows and (with a key) the idempotency record,
/// all or nothing ([`crate::place`]; with group commit, concurrent orders share one statement,
/// each with its own outcome). A key claimed before answers with its job, or 422.
async fn accept(
    pool: &PgPool,
    writer: &Writer,
    order: &ValidOrder,
    claim: Option<Claim>,
    deadline: chrono::DateTime<chrono::Utc>,
) -> Result<Accepted, ApiError> {
    let accepted = Accepted { job_id: Uuid::now_v7(), order_id: Uuid::now_v7() };
    if writer.write(NewOrder::new(accepted.clone(), order, claim.clone(), deadline)).await? {
        return Ok(accepted);
    }
    // The key was claimed before (or just now, by a concurrent request, which this one waited
    // for): the same request gets the same job. jsonb equality ignores key order and whitespace.
    // (Without a key the write always writes.)
    let Claim { key, request } = claim.ok_or_else(|| ApiError::internal("an order without a key was not written"))?;
    let (same, job_id, order_id): (bool, Uuid, Uuid) =
        sqlx::query_as("select request = $1, job_id, order_id from idempotency_keys where key = $2")
            .bind(request)
            .bind(key.as_str())
            .fetch_one(pool)
            .await?;
    if same { Ok(Accepted { job_id, order_id }) } else { Err(ApiError::IdempotencyMismatch) }
}

/// `GET /jobs/{jobId}`.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Job {
    /// The job.
    pub job_id: Uuid,
    /// Its order.
    pub order_id: Uuid,
    /// Its state.
    pub state: crate::jobs::JobState,
    /// Highest attempt any step needed so far.
    pub attempt: i32,
    /// The invoice id once succeeded.
    pub result_key: Option<String>,
    /// The refusal or failure reason.
    pub last_error: Option<String>,
    /// When `order.placed` was confirmed by the broker.
    pub published_at: Option<DateTime<Utc>>,
    /// Accepted at.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// How looking up a job or an order by id can fail (OpenAPI only: the handlers return [`ApiError`]).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum LookupFailure {
    /// Not a UUID.
    #[response(status = 400, content_type = "application/problem+json")]
    MalformedId(Problem),
    /// No such job or order.
    #[response(status = 404, content_type = "application/problem+json")]
    NotFound(Problem),
    /// The database is unreachable, or busy (a lock or a statement past its timeout, a deadlock):
    /// retry later (`Retry-After`, in seconds).
    #[response(status = 503, content_type = "application/problem+json",
               headers(("Retry-After" = String, description = "Seconds")))]
    Unavailable(Problem),
}

/// A job: what a client polls after `POST /orders`.
#[utoipa::path(
    get,
    path = "/jobs/{jobId}",
    tag = "orders",
    params(("jobId" = uuid::Uuid, Path, description = "From the `202` of `POST /orders`.")),
    responses((status = 200, description = "The job.", body = Job), LookupFailure)
)]
pub(crate) async fn get_job(State(pool): State<PgPool>, Path(job_id): Path<String>) -> Result<Json<Job>, ApiError> {
    let job_id = parse_id("job", &job_id)?;
    let job = sqlx::query_as(
        "select id as job_id, order_id, state, attempt, result_key, last_error, published_at, created_at, updated_at
           from jobs where id = $1",
    )
    .bind(job_id)
    .fetch_optional(&pool);
    let job = db::within(QUERY_DEADLINE, job).await?.ok_or_else(|| ApiError::NotFound(format!("no job {job_id}")))?;
    Ok(Json(job))
}

/// A job's story: every step the orders service has learned of, oldest first (accepted,
/// published, each step's failed attempt and wait tier, a park with its reason, a redrive or an
/// abandon, the results, the end decided and its compensation, the end), with when, where, why and
/// the trace each happened in. Open, as `GET /jobs/{jobId}` is (decision 0031).
#[utoipa::path(
    get,
    path = "/jobs/{jobId}/events",
    tag = "orders",
    params(("jobId" = uuid::Uuid, Path, description = "From the `202` of `POST /orders`.")),
    responses((status = 200, description = "The job's story.", body = story::Story), LookupFailure)
)]
pub(crate) async fn get_job_events(
    State(pool): State<PgPool>,
    view: Option<Extension<story::TraceView>>,
    Path(job_id): Path<String>,
) -> Result<Json<story::Story>, ApiError> {
    let job_id = parse_id("job", &job_id)?;
    let story = db::within(QUERY_DEADLINE, story::read(&pool, job_id)).await?;
    let mut story = story.ok_or_else(|| ApiError::NotFound(format!("no job {job_id}")))?;
    if let Some(Extension(view)) = view {
        story.link_traces(&view);
    }
    Ok(Json(story))
}

/// `GET /orders/{orderId}`.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Order {
    /// The order.
    pub order_id: Uuid,
    /// Its job.
    pub job_id: Uuid,
    /// Who ordered.
    pub customer_id: String,
    /// Where it is.
    pub status: OrderStatus,
    /// What.
    #[sqlx(json)]
    #[schema(value_type = Vec<OrderLineRequest>)]
    pub lines: Vec<OrderLine>,
    /// Accepted at.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// An order, with its lines and its job.
#[utoipa::path(
    get,
    path = "/orders/{orderId}",
    tag = "orders",
    params(("orderId" = uuid::Uuid, Path, description = "From the `202` of `POST /orders`.")),
    responses((status = 200, description = "The order.", body = Order), LookupFailure)
)]
pub(crate) async fn get_order(
    State(pool): State<PgPool>,
    Path(order_id): Path<String>,
) -> Result<Json<Order>, ApiError> {
    let order_id = parse_id("order", &order_id)?;
    let order = sqlx::query_as(
        "select o.id as order_id, j.id as job_id, o.customer_id, o.status, o.created_at, o.updated_at,
                (select coalesce(json_agg(json_build_object('sku', l.sku, 'quantity', l.quantity) order by l.line_no), '[]')
                   from order_lines l where l.order_id = o.id) as lines
           from orders o join jobs j on j.order_id = o.id
          where o.id = $1",
    )
    .bind(order_id)
    .fetch_optional(&pool);
    let order =
        db::within(QUERY_DEADLINE, order).await?.ok_or_else(|| ApiError::NotFound(format!("no order {order_id}")))?;
    Ok(Json(order))
}

/// Why a customer's cancel ended an order.
pub const CANCELLED_BY_CUSTOMER: &str = "cancelled by the customer";
/// The reason an operator's cancel gives.
pub const CANCELLED_BY_OPERATOR: &str = "cancelled by an operator";

/// How cancelling an order can fail, beyond a lookup (OpenAPI only).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum CancelFailure {
    /// The order has ended otherwise (invoiced, rejected, declined): it can no longer be cancelled.
    #[response(status = 409, content_type = "application/problem+json")]
    Ended(Problem),
    /// No bearer token, or one refused: nothing changed.
    #[response(status = 401, content_type = "application/problem+json")]
    Unauthenticated(Problem),
    /// The order is another customer's: nothing changed.
    #[response(status = 403, content_type = "application/problem+json")]
    AnotherCustomers(Problem),
}

/// Cancel an order that has not ended: it ends `cancelled`, and what it took (reserved stock, an
/// invoice) is given back; its job shows `compensating` until then, and `cancelled` after.
/// Idempotent: cancelling a cancelled order answers 202 again. Only the order's customer (its
/// bearer token's `sub`) or an operator may.
#[utoipa::path(
    post,
    path = "/orders/{orderId}/cancel",
    tag = "orders",
    security(("bearer" = [])),
    params(("orderId" = uuid::Uuid, Path, description = "From the `202` of `POST /orders`.")),
    responses(
        (status = 202, description = "Cancelled, or cancelled before: poll the job.", body = Accepted,
         headers(("Location" = String, description = "The job: `/jobs/{jobId}`"))),
        CancelFailure,
        LookupFailure,
    )
)]
pub(crate) async fn cancel_order(
    State(pool): State<PgPool>,
    caller: Caller,
    Path(order_id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let order_id = parse_id("order", &order_id)?;
    // The cancel is a trace of its own (or the caller's), as `POST /orders` is: its `order.ended`
    // and the compensation it causes follow it, and the job's story names it.
    let span = request_span!("POST /orders/{orderId}/cancel", "/orders/{orderId}/cancel");
    let cancelled = db::within(QUERY_DEADLINE, cancel(&pool, &caller, order_id));
    let accepted = traced(&headers, span, cancelled).await?;
    let location = format!("/jobs/{}", accepted.job_id);
    Ok((StatusCode::ACCEPTED, [(header::LOCATION, location)], Json(accepted)).into_response())
}

/// Decide the order's end, `cancelled`, and announce it, in one transaction ([`jobs::decide`]),
/// if `caller` may. Begun by [`db::Taken::begin`]: the request's deadline may give it up
/// mid-`BEGIN`.
async fn cancel(pool: &PgPool, caller: &Caller, order_id: Uuid) -> Result<Accepted, ApiError> {
    let mut conn = db::Taken::acquire(pool).await?;
    let mut tx = conn.begin().await?;
    let found: Option<(Uuid, String)> = sqlx::query_as(
        "select jobs.id, orders.customer_id from jobs join orders on orders.id = jobs.order_id where jobs.order_id = $1",
    )
    .bind(order_id)
    .fetch_optional(&mut *tx)
    .await?;
    let (job_id, customer_id) = found.ok_or_else(|| ApiError::NotFound(format!("no order {order_id}")))?;
    let reason = match caller {
        Caller::Operator(_) => CANCELLED_BY_OPERATOR,
        Caller::Customer(_) if caller.acts_for(&customer_id) => CANCELLED_BY_CUSTOMER,
        Caller::Customer(_) => {
            return Err(ApiError::Forbidden(format!("order {order_id} is another customer's: only it may cancel it")));
        }
    };
    let accepted = Accepted { job_id, order_id };
    match jobs::decide(&mut tx, job_id, shop::End::Cancelled, Some(reason), None).await? {
        jobs::Decided::Now(..) => {
            tx.commit().await?;
            Ok(accepted)
        }
        jobs::Decided::UnknownJob => Err(ApiError::NotFound(format!("no order {order_id}"))),
        jobs::Decided::Before => {
            // Decided before, by this route or otherwise: which end?
            let status: OrderStatus = sqlx::query_scalar("select status from orders where id = $1")
                .bind(order_id)
                .fetch_one(&mut *tx)
                .await?;
            match status {
                OrderStatus::Cancelled => Ok(accepted),
                ended => Err(ApiError::Conflict(format!(
                    "order {order_id} has ended {}: it can no longer be cancelled",
                    ended.as_str()
                ))),
            }
        }
    }
}

fn parse_id(what: &str, raw: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(raw).map_err(|_| ApiError::BadRequest(format!("malformed {what} id `{raw}`: expected a UUID")))
}

/// Problem+json 404 for unknown routes.
pub async fn no_route() -> ApiError {
    ApiError::NotFound("no such resource".into())
}
