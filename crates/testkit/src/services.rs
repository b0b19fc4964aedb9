//! The shop's four services, as the harness and the roles name them, and their instances.

use std::fmt;

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

/// One running copy of a service: a shop can run several of each
/// ([`crate::shop::Options::instances`]). A bare [`Service`] means its first instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Instance {
    /// Which service.
    pub service: Service,
    /// Which copy of it, from 0.
    pub index: usize,
}

impl From<Service> for Instance {
    fn from(service: Service) -> Self {
        Self { service, index: 0 }
    }
}

impl fmt::Display for Instance {
    /// `orders-api` for the first instance, `orders-api-2` for the second: the name of its logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.index {
            0 => f.write_str(self.service.binary()),
            n => write!(f, "{}-{}", self.service.binary(), n + 1),
        }
    }
}
