//! The shop (`docs/architecture.md`): the message contracts its services exchange, one struct per
//! message type with its type name, exchange and schema version, and who consumes them
//! ([`topology`]). Contracts only: the demo's faults and catalogue are `shop-demo`'s, and the check
//! of the services' books against one another is `shop-books`'. Producers and consumers share
//! these definitions, so a field cannot drift between them. Bodies are camelCase JSON; unknown
//! fields are ignored, so adding an optional field is a compatible (minor) change, while removing
//! or retyping one needs a new major version.
//!
//! `messaging` knows none of this: it moves any [`Contract`].

pub mod topology;

use chrono::{DateTime, Utc};
use messaging_core::contracts::Contract;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The shop's topic exchanges, one per producing service (durable). The deploy step declares them
/// ([`topology`]); a service whose broker user may configure them declares one it finds missing. The consumer runtime's job events go to `messaging`'s own
/// exchange ([`messaging_core::contracts::JOBS_EXCHANGE`]).
pub mod exchanges {
    /// `order.placed`, `order.ended`, `order.deadline`.
    pub const ORDERS: &str = "orders";
    /// `inventory.reserved`, `inventory.rejected`, `inventory.released`.
    pub const INVENTORY: &str = "inventory";
    /// `invoice.created`, `payment.declined`, `invoice.voided`.
    pub const BILLING: &str = "billing";
}

/// Whether `message_type` undoes an order's steps, or answers that it did: `order.ended` (which
/// inventory and billing act on) and their answers `inventory.released` and `invoice.voided`.
/// Such a message comes after the order has ended, so nothing would send it again: deleted while
/// parked, its job stays `compensating` and what the order took stays taken. `msgctl` refuses to
/// purge or abandon one; the list is every undo contract below, and a new one goes in it too.
pub fn is_undo(message_type: &str) -> bool {
    [OrderEnded::TYPE, InventoryReleased::TYPE, InvoiceVoided::TYPE].contains(&message_type)
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

/// The ordering key ([`messaging_core::outbox::Outgoing::ordered_by`]) under which the orders service
/// sends an order's `order.placed` and `order.ended`: inventory, ordered by key, applies an order's
/// end after its placing, whatever order they arrive in (decisions 0023, 0024). The scheduled
/// `order.deadline` carries none.
pub fn order_key(order_id: Uuid) -> String {
    format!("order:{order_id}")
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
    /// When the order is cancelled if it has not ended (`ORDER_DEADLINE` after it was accepted).
    /// Optional: a minor, compatible addition (decision 0023).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
}
impl Contract for OrderPlaced {
    const TYPE: &'static str = "order.placed";
    const EXCHANGE: &'static str = exchanges::ORDERS;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}

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
    /// The order's deadline, copied from `order.placed`: billing declines a reservation it
    /// receives after it (reason [`EXPIRED`]), so that billing, started late, invoices nothing for
    /// an order the orders service has cancelled at its deadline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<DateTime<Utc>>,
}
impl Contract for InventoryReserved {
    const TYPE: &'static str = "inventory.reserved";
    const EXCHANGE: &'static str = exchanges::INVENTORY;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}

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
impl Contract for InventoryRejected {
    const TYPE: &'static str = "inventory.rejected";
    const EXCHANGE: &'static str = exchanges::INVENTORY;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}

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
impl Contract for InvoiceCreated {
    const TYPE: &'static str = "invoice.created";
    const EXCHANGE: &'static str = exchanges::BILLING;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}

/// The reason billing gives when it declines a reservation received after the order's deadline.
pub const EXPIRED: &str = "expired: the order's deadline passed before billing";

/// Billing refused the order: a business outcome (a declined payment, an expired order), not an
/// error. The orders service ends the order `declined` and compensates it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PaymentDeclined {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
    /// Why, for people.
    pub reason: String,
}
impl Contract for PaymentDeclined {
    const TYPE: &'static str = "payment.declined";
    const EXCHANGE: &'static str = exchanges::BILLING;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}

/// The routing key pattern of every `order.ended`, whatever its end ([`End::routing_key`]), and of
/// those of releases before routing by end, which had none (`order.ended`): `#` is any number of
/// words, none included.
pub const EVERY_END: &str = "order.ended.#";

/// How an order ended, as the orders service decided it (decision 0023).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum End {
    /// Billing invoiced it: inventory settles the reservation (and answers nothing: no one waits).
    Invoiced,
    /// Billing refused it: inventory releases the reservation, billing voids any invoice.
    Declined,
    /// The customer, the deadline or an operator ended it: as `Declined`.
    Cancelled,
}

impl End {
    /// The name in `order.ended` and in the orders database.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Invoiced => "invoiced",
            Self::Declined => "declined",
            Self::Cancelled => "cancelled",
        }
    }

    /// The routing key of an `order.ended` of this end: `order.ended.<end>` ([`OrderEnded`]).
    pub fn routing_key(self) -> &'static str {
        match self {
            Self::Invoiced => "order.ended.invoiced",
            Self::Declined => "order.ended.declined",
            Self::Cancelled => "order.ended.cancelled",
        }
    }
}

/// The orders service decided how an order ends; the decision is final. Every service that did
/// something for the order keeps it (`invoiced`) or undoes it (any other end), and answers.
///
/// Routed by its end, `order.ended.<end>` ([`End::routing_key`], issue 59): a consumer of every
/// end binds [`EVERY_END`], one that only undoes binds the ends it undoes. Releases before
/// 2026-12-07 published every end as `order.ended`: `EVERY_END` matches it, and billing binds it
/// while rows of theirs may be unpublished (`docs/operations.md`, "Routing `order.ended` by its
/// end").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrderEnded {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
    /// How it ended.
    pub end: End,
    /// Why, for people (none for `invoiced`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}
impl Contract for OrderEnded {
    const TYPE: &'static str = "order.ended";
    const EXCHANGE: &'static str = exchanges::ORDERS;
    const ROUTED_BY_BODY: bool = true;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }

    fn routing_key(&self) -> &'static str {
        self.end.routing_key()
    }
}

/// An order's deadline: scheduled by the orders service when it accepts the order, delivered to
/// itself at the deadline. An order that has not ended by then is cancelled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrderDeadline {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
}
impl Contract for OrderDeadline {
    const TYPE: &'static str = "order.deadline";
    const EXCHANGE: &'static str = exchanges::ORDERS;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}

/// Inventory gave an ended order's stock back (or found none taken, and fenced the order so that a
/// late `order.placed` takes none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InventoryReleased {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
}
impl Contract for InventoryReleased {
    const TYPE: &'static str = "inventory.released";
    const EXCHANGE: &'static str = exchanges::INVENTORY;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}

/// Billing voided an ended order's invoice (or found none, and fenced the order so that a late
/// `inventory.reserved` invoices nothing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InvoiceVoided {
    /// The order.
    pub order_id: Uuid,
    /// The job tracking it.
    pub job_id: Uuid,
}
impl Contract for InvoiceVoided {
    const TYPE: &'static str = "invoice.voided";
    const EXCHANGE: &'static str = exchanges::BILLING;

    fn job(&self) -> Option<Uuid> {
        Some(self.job_id)
    }
}
