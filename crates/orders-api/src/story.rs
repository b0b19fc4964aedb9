//! One job's story (`GET /jobs/{id}/events`, the live page's timeline): every step the orders
//! database learns of, in the order it learns them, with when, where, why and under which trace.
//!
//! A step is written in the transaction that applies it ([`record`]), so it is there exactly when
//! its effect is: the status consumer's events ([`crate::status`]), an order's end decided
//! ([`crate::jobs::decide`]) and the relay's mark of `order.placed` (the outbox trigger, migration
//! 0013). Being accepted is read from the job's row ([`read`]): `POST /orders` writes nothing more
//! for it. A job from before migration 0013 shows its acceptance and what came after the upgrade.

use chrono::{DateTime, Utc};
use messaging::trace;
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::jobs::JobState;

/// What happened to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// `POST /orders` took the order.
    Accepted,
    /// The broker confirmed the order's `order.placed` (the relay's mark).
    Published,
    /// A step's `attempt` failed; its message waits in a retry tier until `dueAt`.
    RetryScheduled,
    /// A step's message was parked after its `attempt`, for the reason in `detail`: the job is
    /// quarantined until an operator redrives or abandons it, or the order ends.
    Parked,
    /// An operator sent a step's parked message back to its work queue (`detail`: its redrive count).
    Redriven,
    /// An operator gave up on a step's parked message (`detail`: why).
    Abandoned,
    /// Inventory reserved the stock.
    Reserved,
    /// Inventory refused the order (`detail`: why).
    Rejected,
    /// Billing invoiced the order (`detail`: the invoice).
    Invoiced,
    /// Billing refused the payment (`detail`: why).
    Declined,
    /// The order's deadline came.
    DeadlineCame,
    /// The order's end was decided otherwise than invoiced (`detail`: why), and `order.ended` sent:
    /// inventory and billing undo what they did.
    Compensating,
    /// `order.ended` went again, unordered: the order's `order.placed` will never be published
    /// (parked in the outbox, or discarded), and an end ordered behind it would wait for good.
    EndResent,
    /// Inventory gave back what the order held (or found nothing to give back).
    Released,
    /// Billing voided the order's invoice (or found none).
    Voided,
    /// The job took its final state (`detail`).
    Ended,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Self; 16] = [
        Self::Accepted,
        Self::Published,
        Self::RetryScheduled,
        Self::Parked,
        Self::Redriven,
        Self::Abandoned,
        Self::Reserved,
        Self::Rejected,
        Self::Invoiced,
        Self::Declined,
        Self::DeadlineCame,
        Self::Compensating,
        Self::EndResent,
        Self::Released,
        Self::Voided,
        Self::Ended,
    ];

    /// The name stored in `job_events.kind` and shown by the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Published => "published",
            Self::RetryScheduled => "retry_scheduled",
            Self::Parked => "parked",
            Self::Redriven => "redriven",
            Self::Abandoned => "abandoned",
            Self::Reserved => "reserved",
            Self::Rejected => "rejected",
            Self::Invoiced => "invoiced",
            Self::Declined => "declined",
            Self::DeadlineCame => "deadline_came",
            Self::Compensating => "compensating",
            Self::EndResent => "end_resent",
            Self::Released => "released",
            Self::Voided => "voided",
            Self::Ended => "ended",
        }
    }
}

impl TryFrom<String> for Kind {
    type Error = String;
    fn try_from(name: String) -> Result<Self, Self::Error> {
        Self::ALL.into_iter().find(|kind| kind.as_str() == name).ok_or_else(|| format!("unknown job event `{name}`"))
    }
}

/// Where, why and what: the parts of a step that some kinds have.
#[derive(Debug, Clone, Copy, Default)]
pub struct Step<'a> {
    /// The step's endpoint, where it is one step's.
    pub endpoint: Option<&'a str>,
    /// The attempt that failed or was parked.
    pub attempt: Option<u32>,
    /// A retry's next attempt is due then.
    pub due_at: Option<DateTime<Utc>>,
    /// The reason, error or result.
    pub detail: Option<&'a str>,
    /// The message applied.
    pub message_id: Option<Uuid>,
}

/// Record that `kind` happened to `job_id`, in `tx`, under the current trace ([`trace::current`]):
/// the delivery's or the request's. Nothing for a job this database does not have: the caller
/// finds that out and answers for it (an event for an unknown job is parked).
pub async fn record(tx: &mut PgConnection, job_id: Uuid, kind: Kind, step: Step<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "insert into job_events (job_id, kind, endpoint, attempt, due_at, detail, trace_id, message_id)
         select id, $1, $2, $3, $4, $5, $6, $7 from jobs where id = $8",
    )
    .bind(kind)
    .bind(step.endpoint)
    .bind(step.attempt.map(|attempt| i32::try_from(attempt).unwrap_or(i32::MAX)))
    .bind(step.due_at)
    .bind(step.detail)
    .bind(trace::current().map(|context| context.trace_hex()))
    .bind(step.message_id)
    .bind(job_id)
    .execute(tx)
    .await
    .map(drop)
}

/// `GET /jobs/{jobId}/events`: a job's story.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Story {
    /// The job.
    pub job_id: Uuid,
    /// Its order.
    pub order_id: Uuid,
    /// Its state now.
    pub state: JobState,
    /// The order's trace (32 hex digits): one trace from the request through every service.
    /// Absent for a job accepted before the trace was kept (migration 0013).
    pub trace_id: Option<String>,
    /// Where the trace is shown: `TRACE_VIEW_URL` with the trace id in it (compose's: the Jaeger
    /// page of the trace). Absent without one or the other.
    pub trace_url: Option<String>,
    /// What happened, oldest first.
    pub events: Vec<Event>,
}

/// One thing that happened to a job.
#[derive(Debug, Clone, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Event {
    /// When the orders database learned it.
    pub at: DateTime<Utc>,
    /// What.
    pub kind: Kind,
    /// The step's endpoint, where it is one step's: a consumer's work queue, or `outbox:<database>`
    /// for a park by the relay (`published` names none).
    pub endpoint: Option<String>,
    /// The attempt that failed or was parked.
    pub attempt: Option<i32>,
    /// A retry's next attempt is due then.
    pub due_at: Option<DateTime<Utc>>,
    /// The reason, error or result.
    pub detail: Option<String>,
    /// The trace it happened in (32 hex digits): the order's, or a cancel's own.
    pub trace_id: Option<String>,
    /// Where that trace is shown, as the story's `traceUrl`.
    #[sqlx(skip)]
    pub trace_url: Option<String>,
    /// The message applied.
    pub message_id: Option<Uuid>,
}

/// The story of `job_id`; `None` if there is no such job.
pub async fn read(pool: &PgPool, job_id: Uuid) -> Result<Option<Story>, sqlx::Error> {
    // One snapshot for the job and its events.
    let mut tx = pool.begin().await?;
    sqlx::query("set transaction isolation level repeatable read, read only").execute(&mut *tx).await?;
    let job: Option<(Uuid, JobState, Option<String>)> =
        sqlx::query_as("select order_id, state, trace_id from jobs where id = $1")
            .bind(job_id)
            .fetch_optional(&mut *tx)
            .await?;
    let Some((order_id, state, trace_id)) = job else { return Ok(None) };
    let events = sqlx::query_as(
        "select at, kind, endpoint, attempt, due_at, detail, trace_id, message_id from (
            select 0 as n, 0::bigint as id, created_at as at, $1 as kind, null::text as endpoint,
                   null::integer as attempt, null::timestamptz as due_at, null::text as detail, trace_id,
                   null::uuid as message_id
              from jobs where id = $2
            union all
            select 1, id, at, kind, endpoint, attempt, due_at, detail, trace_id, message_id
              from job_events where job_id = $2
         ) as story
         order by n, at, id",
    )
    .bind(Kind::Accepted)
    .bind(job_id)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Some(Story { job_id, order_id, state, trace_id, trace_url: None, events }))
}

impl Story {
    /// Link the story's trace and each event's to where `view` shows them.
    pub fn link_traces(&mut self, view: &TraceView) {
        self.trace_url = self.trace_id.as_deref().map(|id| view.link(id));
        for event in &mut self.events {
            event.trace_url = event.trace_id.as_deref().map(|id| view.link(id));
        }
    }
}

/// Where a trace is shown (`TRACE_VIEW_URL`): a URL with `{traceId}` in it, which the trace's 32
/// hex digits replace, such as Jaeger's `http://127.0.0.1:16686/trace/{traceId}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceView(String);

impl TraceView {
    /// The page of `trace_id`.
    pub fn link(&self, trace_id: &str) -> String {
        self.0.replace(TRACE_ID, trace_id)
    }
}

/// What a [`TraceView`] has in place of the trace id.
const TRACE_ID: &str = "{traceId}";

impl std::str::FromStr for TraceView {
    type Err = String;

    fn from_str(template: &str) -> Result<Self, Self::Err> {
        let template = template.trim();
        if !template.contains(TRACE_ID) {
            return Err(format!("`{template}` has no {TRACE_ID} for the trace id to go in"));
        }
        match url::Url::parse(&template.replace(TRACE_ID, &"0".repeat(32))) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => Ok(Self(template.to_owned())),
            _ => Err(format!("`{template}` is not an http:// or https:// URL")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_view_puts_the_trace_id_in_its_place_and_refuses_a_template_without_one() {
        let view: TraceView = "http://127.0.0.1:16686/trace/{traceId}".parse().expect("a template");
        assert_eq!(
            view.link("4bf92f3577b34da6a3ce929d0e0e4736"),
            "http://127.0.0.1:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert!("http://127.0.0.1:16686/trace/".parse::<TraceView>().expect_err("no {traceId}").contains("{traceId}"));
        assert!("jaeger:16686/trace/{traceId}".parse::<TraceView>().expect_err("no scheme").contains("not an http"));
    }

    #[test]
    fn kinds_round_trip_through_their_names_and_the_api() {
        for kind in Kind::ALL {
            assert_eq!(Kind::try_from(kind.as_str().to_owned()), Ok(kind));
            assert_eq!(serde_json::to_value(kind).expect("json"), kind.as_str());
        }
        assert!(Kind::try_from("happened".to_owned()).is_err());
    }
}
