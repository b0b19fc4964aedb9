//! The message contracts of the shop (DESIGN §4): one struct per message type, with its type name,
//! exchange and schema version. Producers and consumers share these definitions, so a field cannot
//! drift between them. Bodies are camelCase JSON; unknown fields are ignored, so adding an optional
//! field is a compatible (minor) change, while removing or retyping one needs a new major version.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Topic exchanges, one per producing service (durable).
pub mod exchanges {
    /// `order.placed`.
    pub const ORDERS: &str = "orders";
    /// `inventory.reserved`, `inventory.rejected`.
    pub const INVENTORY: &str = "inventory";
    /// `invoice.created`.
    pub const BILLING: &str = "billing";
    /// `job.retry_scheduled`, `job.quarantined`.
    pub const JOBS: &str = "jobs";
    /// Every exchange of the shop.
    pub const ALL: [&str; 4] = [ORDERS, INVENTORY, BILLING, JOBS];
}

/// A message type: its name (also its routing key), exchange and current major version.
pub trait Contract: Serialize {
    /// The AMQP `type` and routing key.
    const TYPE: &'static str;
    /// The exchange it is published to.
    const EXCHANGE: &'static str;
    /// The schema major version this code writes and reads.
    const VERSION: u32 = 1;
}

macro_rules! contract {
    ($name:ident, $type:literal, $exchange:expr) => {
        impl Contract for $name {
            const TYPE: &'static str = $type;
            const EXCHANGE: &'static str = $exchange;
        }
    };
}

/// One line of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrderLine {
    /// Stock keeping unit, e.g. `SKU-1`.
    pub sku: String,
    /// How many (1..=1000).
    pub quantity: i32,
}

/// An order was accepted: reserve its stock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrderPlaced {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
    /// Who ordered.
    pub customer_id: String,
    /// What was ordered.
    pub lines: Vec<OrderLine>,
}
contract!(OrderPlaced, "order.placed", exchanges::ORDERS);

/// All lines of an order are reserved: bill it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryReserved {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
    /// The reservation made.
    pub reservation_id: Uuid,
    /// What was reserved (what billing prices).
    pub lines: Vec<OrderLine>,
}
contract!(InventoryReserved, "inventory.reserved", exchanges::INVENTORY);

/// The order cannot be served (unknown SKU, not enough stock): a business outcome, not an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryRejected {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
    /// Why, for people.
    pub reason: String,
}
contract!(InventoryRejected, "inventory.rejected", exchanges::INVENTORY);

/// The order is invoiced: the job has succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InvoiceCreated {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
    /// The invoice (the job's result key).
    pub invoice_id: Uuid,
    /// Sum of quantity × unit price.
    pub total_cents: i64,
}
contract!(InvoiceCreated, "invoice.created", exchanges::BILLING);

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
contract!(JobRetryScheduled, "job.retry_scheduled", exchanges::JOBS);

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
}
contract!(JobQuarantined, "job.quarantined", exchanges::JOBS);

impl JobEvent for JobQuarantined {
    fn job_id(&self) -> Uuid {
        self.job_id
    }
}
