use crate::{runtime::backoff::Backoff, topology::RetryPolicy};

/// The endpoint's settings a decision reads.
#[derive(Debug, Clone)]
pub(in crate::consumer) struct Rules {
    /// Retry tiers and attempt cap.
    pub(in crate::consumer) policy: RetryPolicy,
    /// Starts of a redelivery, alone and never finished, before it is parked.
    pub(in crate::consumer) max_crashes: u32,
    /// Between tries while the database is unreachable.
    pub(in crate::consumer) reconnect: Backoff,
    /// Where the jitter of those waits comes from: a number in `[0, 1)`, `fastrand::f64` in a
    /// service, a fixed one in a test (so that every wait is exact).
    pub(in crate::consumer) draw: fn() -> f64,
}
