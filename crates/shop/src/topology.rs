//! Who in the shop consumes what: each service's endpoint and the exchanges they bind to, in one
//! place. Each service consumes on its own endpoint from here; the deploy step declares all of it
//! before any service publishes (`msgctl topology apply`), and the relay holds a message that
//! would reach fewer of these queues than they bind (decision 0030). A new consumer of the shop's
//! messages is added here first (`docs/adding-a-service.md`).

use messaging_core::{
    contracts::JOBS_EXCHANGE,
    endpoint::{Endpoint, Topology},
};

use crate::{
    EVERY_END, End, InventoryRejected, InventoryReleased, InventoryReserved, InvoiceCreated, InvoiceVoided,
    OrderDeadline, OrderEnded, OrderPlaced, PaymentDeclined, exchanges,
};

/// The whole shop: its exchanges and the three endpoints below.
pub fn shop() -> Topology {
    Topology::new([exchanges::ORDERS, exchanges::INVENTORY, exchanges::BILLING, JOBS_EXCHANGE])
        .endpoint(orders_status())
        .endpoint(inventory())
        .endpoint(billing())
}

/// The orders service's `orders.status`: every outcome of every step, the compensations'
/// answers, the orders' own deadlines, and the runtime's job events (`job.#`). What it accepts is
/// what its handler routes (orders-api's `status::handler`, eleven contracts): bound here, listed
/// there once.
pub fn orders_status() -> Endpoint {
    Endpoint::new("orders.status")
        .bind_contract::<InventoryReserved>()
        .bind_contract::<InventoryRejected>()
        .bind_contract::<InventoryReleased>()
        .bind_contract::<InvoiceCreated>()
        .bind_contract::<PaymentDeclined>()
        .bind_contract::<InvoiceVoided>()
        .bind_contract::<OrderDeadline>()
        .bind(JOBS_EXCHANGE, "job.#")
}

/// The routing key of every `order.ended` published by releases before 2026-12-07, which did not
/// route it by its end ([`End::routing_key`]). Billing, which binds only some ends, binds it as
/// well while such rows may still be unpublished; the release after drops it, and an administrator
/// deletes the binding (`docs/operations.md`, "Routing `order.ended` by its end"). [`EVERY_END`]
/// matches it already.
pub const ENDED_BEFORE_ROUTING_BY_END: &str = "order.ended";

/// Inventory's `inventory.order-placed`: `order.placed` and every `order.ended`, ordered by key,
/// so that an order's end is applied after its placing ([`crate::order_key`]). The name is the one
/// it had before orders could end otherwise than invoiced or rejected.
pub fn inventory() -> Endpoint {
    Endpoint::new("inventory.order-placed")
        .consume::<OrderPlaced>()
        .consume_keys::<OrderEnded>(&[EVERY_END])
        .ordered_by_key()
}

/// Billing's `billing.inventory-reserved`: `inventory.reserved`, and the ends it undoes
/// (`declined`, `cancelled`): an invoiced order's end asks nothing of billing, and is not sent to
/// it.
pub fn billing() -> Endpoint {
    Endpoint::new("billing.inventory-reserved").consume::<InventoryReserved>().consume_keys::<OrderEnded>(&[
        End::Declined.routing_key(),
        End::Cancelled.routing_key(),
        ENDED_BEFORE_ROUTING_BY_END,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use messaging_core::contracts::{Contract, JobAbandoned};

    #[test]
    fn an_order_s_end_reaches_inventory_and_billing_only_if_it_must_undo() {
        let shop = shop();
        let ended = |end| OrderEnded { order_id: uuid::Uuid::nil(), job_id: uuid::Uuid::nil(), end, reason: None };
        for end in [End::Declined, End::Cancelled] {
            assert_eq!(
                shop.queues_for(exchanges::ORDERS, ended(end).routing_key()),
                ["inventory.order-placed", "billing.inventory-reserved"]
            );
        }
        assert_eq!(shop.queues_for(exchanges::ORDERS, ended(End::Invoiced).routing_key()), ["inventory.order-placed"]);
        // An earlier release's, of any end, while the move lasts.
        assert_eq!(
            shop.queues_for(exchanges::ORDERS, OrderEnded::TYPE),
            ["inventory.order-placed", "billing.inventory-reserved"]
        );
        assert_eq!(shop.queues_for(exchanges::ORDERS, OrderPlaced::TYPE), ["inventory.order-placed"]);
        assert_eq!(shop.queues_for(JOBS_EXCHANGE, JobAbandoned::TYPE), ["orders.status"]);
    }
}
