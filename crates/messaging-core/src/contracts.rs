//! What a message type is ([`Contract`]: its name, exchange and schema major version), and the
//! contracts of the consumer runtime's own job events (`docs/architecture.md`), which it publishes
//! to [`JOBS_EXCHANGE`] with the job id as correlation id. Services define their own contracts in a
//! crate they share. Bodies are camelCase JSON; unknown fields are ignored, so adding an optional
//! field is a compatible (minor) change, while removing or retyping one needs a new major version.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The topic exchange of the job events (durable).
pub const JOBS_EXCHANGE: &str = "jobs";

/// A message type: its name (also its routing key, unless [`Contract::routing_key`] says
/// otherwise), exchange and current major version.
///
/// ```
/// use messaging_core::contracts::Contract;
/// use serde::{Deserialize, Serialize};
///
/// /// A parcel left the warehouse.
/// #[derive(Debug, Serialize, Deserialize)]
/// #[serde(rename_all = "camelCase")]
/// struct ParcelShipped {
///     order_id: uuid::Uuid,
///     job_id: uuid::Uuid,
/// }
///
/// impl Contract for ParcelShipped {
///     const TYPE: &'static str = "parcel.shipped";
///     const EXCHANGE: &'static str = "shipping";
///     // VERSION defaults to 1: a new major version is a new number here.
///
///     fn job(&self) -> Option<uuid::Uuid> {
///         Some(self.job_id)
///     }
/// }
///
/// let body = serde_json::to_string(&ParcelShipped { order_id: uuid::Uuid::nil(), job_id: uuid::Uuid::nil() })?;
/// assert!(body.starts_with(r#"{"orderId":"#));
/// # Ok::<(), serde_json::Error>(())
/// ```
pub trait Contract: Serialize {
    /// The AMQP `type`, and the routing key unless [`Contract::routing_key`] says otherwise.
    const TYPE: &'static str;
    /// The exchange it is published to.
    const EXCHANGE: &'static str;
    /// The schema major version this code writes and reads.
    const VERSION: u32 = 1;
    /// Whether its messages are routed by what they say ([`Contract::routing_key`]) rather than
    /// under [`Contract::TYPE`]: then binding its type alone (`Endpoint::consume`) or writing its
    /// rows under it (`outbox::Selected`) would misroute it, and is refused at compile time.
    const ROUTED_BY_BODY: bool = false;

    /// The job a message of this contract belongs to, as its body names it, if it does: the
    /// runtime's fallback when a message carries no correlation id
    /// (the handler's `Context::job_id`).
    fn job(&self) -> Option<Uuid> {
        None
    }

    /// The routing key this message is published with: its type, unless the contract routes by
    /// what the message says (`order.ended.<end>`, with [`Contract::ROUTED_BY_BODY`]), so that a
    /// consumer binds only the messages it acts on. A consumer of every one binds a pattern
    /// (`order.ended.#`).
    fn routing_key(&self) -> &'static str {
        Self::TYPE
    }
}

macro_rules! contract {
    ($name:ident, $type:literal, $exchange:expr) => {
        impl Contract for $name {
            const TYPE: &'static str = $type;
            const EXCHANGE: &'static str = $exchange;

            fn job(&self) -> Option<Uuid> {
                Some(self.job_id)
            }
        }
    };
}

/// Whether `message_type` is one of the runtime's job events. A consumer that retries or parks a
/// job event reports nothing about it: the report would be a job event of the same job, and a
/// status consumer that cannot apply one (a job its database does not have) would park its own
/// report, and the next, without end. The list is every `impl JobEvent` below: a new job event
/// goes in it too.
pub fn is_job_event(message_type: &str) -> bool {
    [JobRetryScheduled::TYPE, JobQuarantined::TYPE, JobRedriven::TYPE, JobAbandoned::TYPE].contains(&message_type)
}

/// An event about a job, published by the consumer runtime with the job id as its correlation id.
pub trait JobEvent: Contract {
    /// The job it is about.
    fn job_id(&self) -> Uuid;
}

/// A step of a job failed transiently and will be tried again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobRetryScheduled {
    /// The job (the failing message's correlation id).
    pub job_id: Uuid,
    /// The endpoint that failed.
    pub endpoint: String,
    /// The message that failed.
    pub message_id: Uuid,
    /// Its type.
    pub message_type: String,
    /// The attempt that failed (1-based).
    pub attempt: u32,
    /// The attempt that comes next.
    pub next_attempt: u32,
    /// When the next attempt is due.
    pub next_attempt_at: DateTime<Utc>,
    /// What went wrong.
    pub error: String,
}
contract!(JobRetryScheduled, "job.retry_scheduled", JOBS_EXCHANGE);

impl JobEvent for JobRetryScheduled {
    fn job_id(&self) -> Uuid {
        self.job_id
    }
}

/// A step of a job was parked: it will not be retried without an operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobQuarantined {
    /// The job (the failing message's correlation id).
    pub job_id: Uuid,
    /// The endpoint that parked it.
    pub endpoint: String,
    /// The parked message, when it had a readable id.
    pub message_id: Option<Uuid>,
    /// Its type, when it had one.
    pub message_type: Option<String>,
    /// The last attempt made (1-based).
    pub attempt: u32,
    /// Why it was parked.
    pub error: String,
    /// How many times the message had been redriven when it was parked (its `redrive-count`
    /// header; 0 if never). Optional in the body: a minor, compatible addition.
    #[serde(default)]
    pub redrive_count: u32,
}
contract!(JobQuarantined, "job.quarantined", JOBS_EXCHANGE);

/// An operator sent a step's parked message back to its work queue (`msgctl parked redrive`): the
/// job leaves `quarantined`, unless a message of another of its steps is still parked, and ends as
/// the new attempts go. Published, confirmed, once the copy is confirmed and before the parked
/// message is acked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobRedriven {
    /// The job (the message's correlation id).
    pub job_id: Uuid,
    /// The endpoint it goes back to.
    pub endpoint: String,
    /// The message.
    pub message_id: Uuid,
    /// How many times it has been redriven, this time included.
    pub redrive_count: u32,
}
contract!(JobRedriven, "job.redriven", JOBS_EXCHANGE);

impl JobEvent for JobRedriven {
    fn job_id(&self) -> Uuid {
        self.job_id
    }
}

/// An operator ended a job whose step's message is parked (`msgctl parked abandon`): the service
/// that owns the job ends it for good and undoes what its steps did. Published, confirmed, before
/// the parked message is acked, so that the job is never left parked by nobody.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct JobAbandoned {
    /// The job (the message's correlation id).
    pub job_id: Uuid,
    /// The endpoint whose parking queue held the message.
    pub endpoint: String,
    /// The message.
    pub message_id: Uuid,
    /// Why, for people (the operator's `--reason`).
    pub reason: String,
}
contract!(JobAbandoned, "job.abandoned", JOBS_EXCHANGE);

impl JobEvent for JobAbandoned {
    fn job_id(&self) -> Uuid {
        self.job_id
    }
}

impl JobEvent for JobQuarantined {
    fn job_id(&self) -> Uuid {
        self.job_id
    }
}
