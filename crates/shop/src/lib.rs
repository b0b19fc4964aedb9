//! The shop (DESIGN §4): the message contracts its services exchange, one struct per message
//! type with its type name, exchange and schema version, and the demo's fault injection. Producers
//! and consumers share these definitions, so a field cannot drift between them. Bodies are
//! camelCase JSON; unknown fields are ignored, so adding an optional field is a compatible (minor)
//! change, while removing or retyping one needs a new major version.
//!
//! `messaging` knows none of this: it moves any [`Contract`].

pub mod demo;

use messaging::contracts::Contract;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The shop's topic exchanges, one per producing service (durable). Whoever binds to one or
/// publishes to one declares it. The consumer runtime's job events go to `messaging`'s own
/// exchange ([`messaging::contracts::JOBS_EXCHANGE`]).
pub mod exchanges {
    /// `order.placed`.
    pub const ORDERS: &str = "orders";
    /// `inventory.reserved`, `inventory.rejected`.
    pub const INVENTORY: &str = "inventory";
    /// `invoice.created`.
    pub const BILLING: &str = "billing";
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
