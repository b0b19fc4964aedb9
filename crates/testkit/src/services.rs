//! The shop's four services, as the harness and the roles name them.

/// The four services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Service {
    /// `orders-api` (and its job-status consumer).
    Api,
    /// `inventory-worker`.
    Inventory,
    /// `billing-worker`.
    Billing,
    /// `relay`, for all three outboxes.
    Relay,
}

impl Service {
    /// Every service, in start order (the relay last: it needs the others' tables).
    pub const ALL: [Self; 4] = [Self::Api, Self::Inventory, Self::Billing, Self::Relay];

    /// The binary's name.
    pub fn binary(self) -> &'static str {
        match self {
            Self::Api => "orders-api",
            Self::Inventory => "inventory-worker",
            Self::Billing => "billing-worker",
            Self::Relay => "relay",
        }
    }
}
