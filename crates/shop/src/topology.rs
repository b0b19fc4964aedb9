//! Who in the shop consumes what: each service's endpoint and the exchanges they bind to, in one
//! place. Each service consumes on its own endpoint from here; the deploy step declares all of it
//! before any service publishes (`msgctl topology apply`), and the relay holds a message that
//! would reach fewer of these queues than they bind (decision 0030). A new consumer of the shop's
//! messages is added here first (`docs/adding-a-service.md`).

use messaging_core::{
    contracts::{JOBS_EXCHANGE, JobAbandoned, JobQuarantined, JobRedriven, JobRetryScheduled},
    endpoint::{Endpoint, Topology},
};

use crate::{
    InventoryRejected, InventoryReleased, InventoryReserved, InvoiceCreated, InvoiceVoided, OrderDeadline, OrderEnded,
    OrderPlaced, PaymentDeclined, exchanges,
};

/// The whole shop: its exchanges and the three endpoints below.
pub fn shop() -> Topology {
    Topology::new([exchanges::ORDERS, exchanges::INVENTORY, exchanges::BILLING, JOBS_EXCHANGE])
        .endpoint(orders_status())
        .endpoint(inventory())
        .endpoint(billing())
}

/// The orders service's `orders.status`: every outcome of every step, the compensations'
/// answers, the orders' own deadlines, and the runtime's job events.
pub fn orders_status() -> Endpoint {
    Endpoint::new("orders.status")
        .consume::<InventoryReserved>()
        .consume::<InventoryRejected>()
        .consume::<InventoryReleased>()
        .consume::<InvoiceCreated>()
        .consume::<PaymentDeclined>()
        .consume::<InvoiceVoided>()
        .consume::<OrderDeadline>()
        .bind(JOBS_EXCHANGE, "job.#")
        .accept::<JobRetryScheduled>()
        .accept::<JobQuarantined>()
        .accept::<JobRedriven>()
        .accept::<JobAbandoned>()
}

/// Inventory's `inventory.order-placed`: `order.placed` and `order.ended`, ordered by key, so that
/// an order's end is applied after its placing ([`crate::order_key`]). The name is the one it had
/// before orders could end otherwise than invoiced or rejected.
pub fn inventory() -> Endpoint {
    Endpoint::new("inventory.order-placed").consume::<OrderPlaced>().consume::<OrderEnded>().ordered_by_key()
}

/// Billing's `billing.inventory-reserved`: `inventory.reserved` and `order.ended`.
pub fn billing() -> Endpoint {
    Endpoint::new("billing.inventory-reserved").consume::<InventoryReserved>().consume::<OrderEnded>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use messaging_core::contracts::Contract;

    #[test]
    fn an_order_s_end_must_reach_inventory_and_billing() {
        let shop = shop();
        assert_eq!(
            shop.queues_for(exchanges::ORDERS, OrderEnded::TYPE),
            ["inventory.order-placed", "billing.inventory-reserved"]
        );
        assert_eq!(shop.queues_for(exchanges::ORDERS, OrderPlaced::TYPE), ["inventory.order-placed"]);
        assert_eq!(shop.queues_for(JOBS_EXCHANGE, JobAbandoned::TYPE), ["orders.status"]);
    }
}
