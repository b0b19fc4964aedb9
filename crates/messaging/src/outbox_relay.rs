//! The relay's side of the outbox ([`messaging_core::outbox`], from `messaging-core`, is the writers'): claim the rows that are
//! due, mark what the broker confirmed, record a failed publish, and set aside a row the broker
//! keeps refusing.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lapin::BasicProperties;
use messaging_core::{envelope::Headers, trace::TraceContext};
use sqlx::{PgConnection, postgres::PgConnectOptions, types::Json};
use uuid::Uuid;

/// An unpublished outbox row, claimed by a relay.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxRow {
    /// Publication order.
    pub id: i64,
    /// Stable message id.
    pub message_id: Uuid,
    /// e.g. `user.registered`.
    pub message_type: String,
    /// Target exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// The JSON body as text, exactly as stored.
    pub payload: String,
    /// Correlation id, traceparent, version.
    pub headers: Json<Headers>,
    /// When the business change committed (the AMQP timestamp).
    pub created_at: DateTime<Utc>,
    /// Failed publish attempts so far, of any kind.
    pub attempts: i32,
    /// Of those, the publishes that closed the channel ([`record_refusal`]): what parks a row.
    pub refusals: i32,
}

impl OutboxRow {
    /// The AMQP properties this row is published with.
    pub fn properties(&self) -> BasicProperties {
        self.headers.properties(self.message_id, &self.message_type, self.created_at)
    }

    /// The span of one send of this row, in the trace its `traceparent` names: a child of the
    /// span that wrote the row, from the send to the commit that marks the row published (its
    /// `outcome`, and `marked` once that commit is done). Made for the collector alone (it is never
    /// entered, and nothing is logged in it), so none is made unless this process exports spans
    /// and the row carries a sampled trace. The consumers' delivery spans
    /// are its siblings, children of the writer's span: the message's `traceparent` is published
    /// as stored, and the relay's spans never change what a consumer sees.
    pub fn publish_span(&self) -> tracing::Span {
        let Some(writer) = crate::runtime::otel::exporting()
            .then(|| self.headers.traceparent.as_deref().and_then(TraceContext::parse))
            .flatten()
            .filter(|writer| writer.sampled)
        else {
            return tracing::Span::none();
        };
        let span = tracing::info_span!(
            "publish",
            otel.kind = "producer",
            otel.status_code = tracing::field::Empty,
            message_id = %self.message_id,
            message_type = %self.message_type,
            exchange = %self.exchange,
            routing_key = %self.routing_key,
            outbox_id = self.id,
            outcome = tracing::field::Empty,
            marked = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            parent_id = tracing::field::Empty,
            sampled = tracing::field::Empty,
        );
        writer.child().record_on(&span);
        span
    }
}

/// `options` for the sessions that claim: the claim's search is planned as a walk of the index of
/// unpublished rows in id order, never a bitmap or sequential scan (set at connection start, no
/// round trip).
///
/// Every row marked published leaves a dead entry in that index (`outbox_unpublished`) until a
/// vacuum removes it, and on a large outbox autovacuum comes only after a fifth of the table has
/// changed. A plain index scan marks each dead entry it meets as dead (Postgres's
/// `kill_prior_tuple`), so the next claim skips it without visiting the table. A bitmap scan, the
/// planner's choice when its statistics promise tens to hundreds of unpublished rows, marks
/// nothing, and a sequential scan reads the whole table: either way every claim read every row
/// published since the last vacuum. At 44 orders/s after a burst, a claim's bitmap scan went
/// through 5,364 entries and 586 table pages (1.2 ms), and the claims took half the time Postgres
/// spent in the shop's statements (`docs/benchmarks.md`, "The latest runs"). An entry can be
/// marked only once no open snapshot can see its row: a long transaction holds them all back, as
/// it holds back vacuum. Both settings apply to every statement of the session; each of the
/// relay's others has an index to go by (decision 0028).
pub fn claiming(options: PgConnectOptions) -> PgConnectOptions {
    options.options([("enable_bitmapscan", "off"), ("enable_seqscan", "off")])
}

/// The claim's statement ([`claim_unpublished`]), `$1` the most rows: for `EXPLAIN` in tests.
pub const CLAIM: &str = "with due as (
            select id from outbox
             where published_at is null and not scheduled and parked_at is null and available_at <= now()
             order by id limit $1
               for update skip locked
         ), due_scheduled as (
            select id from outbox
             where published_at is null and scheduled and parked_at is null and available_at <= now()
             order by available_at limit $1
               for update skip locked
         )
         select id, message_id, message_type, exchange, routing_key, payload::text as payload,
                headers, created_at, attempts, refusals
           from outbox
          where id in (select id from due union all select id from due_scheduled)
          order by id
          limit $1";

/// Lock up to `limit` unpublished rows that are due, oldest first, skipping rows another relay
/// holds and parked rows ([`park`]): several relays can run against one database without
/// publishing a row twice in steady state. The locks last until the caller's transaction ends.
/// Scheduled rows ([`Outgoing::at`](messaging_core::outbox::Outgoing::at)) are looked up apart, by due time, in their own index.
/// Run it on a session opened with [`claiming`]: planned otherwise, its cost can grow with every
/// row published since the outbox was last vacuumed.
pub async fn claim_unpublished(conn: &mut PgConnection, limit: i64) -> sqlx::Result<Vec<OutboxRow>> {
    sqlx::query_as(CLAIM).bind(limit).fetch_all(conn).await
}

/// Mark exactly these rows as published (one statement for the whole confirmed batch).
pub async fn mark_published(conn: &mut PgConnection, ids: &[i64]) -> sqlx::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query("update outbox set published_at = now(), last_error = null where id = any($1)")
        .bind(ids)
        .execute(conn)
        .await
        .map(drop)
}

/// Record a failed publish (returned, nacked): the row stays unpublished and is not claimed again
/// before `retry_after` has passed.
pub async fn record_failure(conn: &mut PgConnection, id: i64, error: &str, retry_after: Duration) -> sqlx::Result<()> {
    record_attempt(conn, id, error, retry_after, 0).await
}

/// Record a publish that closed the channel on its own (the broker refuses the row itself): as
/// [`record_failure`], and counted in `refusals`, on which parking ([`park`]) is decided.
pub async fn record_refusal(conn: &mut PgConnection, id: i64, error: &str, retry_after: Duration) -> sqlx::Result<()> {
    record_attempt(conn, id, error, retry_after, 1).await
}

async fn record_attempt(
    conn: &mut PgConnection,
    id: i64,
    error: &str,
    retry_after: Duration,
    refusals: i32,
) -> sqlx::Result<()> {
    let retry_ms = i64::try_from(retry_after.as_millis()).unwrap_or(i64::MAX);
    sqlx::query(
        "update outbox
            set attempts = attempts + 1,
                refusals = refusals + $1,
                last_error = $2,
                available_at = now() + $3 * interval '1 millisecond'
          where id = $4",
    )
    .bind(refusals)
    .bind(error)
    .bind(retry_ms)
    .bind(id)
    .execute(conn)
    .await
    .map(drop)
}

/// Set a row the broker keeps refusing aside, with the broker's reason: the claim skips it from now
/// on (the rows behind it flow) until an operator re-arms it (`msgctl outbox retry`).
pub async fn park(conn: &mut PgConnection, id: i64, error: &str) -> sqlx::Result<()> {
    sqlx::query(
        "update outbox set attempts = attempts + 1, refusals = refusals + 1, last_error = $1, parked_at = now()
          where id = $2",
    )
    .bind(error)
    .bind(id)
    .execute(conn)
    .await
    .map(drop)
}
