use std::time::Duration;

/// The copy a settlement publishes (confirmed) before its ack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::consumer) enum Republish {
    /// To the wait tier for `delay`, with one more retry.
    Retry {
        /// The wait tier.
        delay: Duration,
        /// Why, recorded on the `job.retry_scheduled` event.
        error: String,
        /// Retries before this delivery.
        retry_count: u32,
    },
    /// To the parking queue, with `reason`.
    Park {
        /// Why, recorded on the parked copy and its `job.quarantined` event.
        reason: String,
        /// Retries before this delivery.
        retry_count: u32,
    },
    /// To the first wait tier, its deferrals counted and its attempts untouched: it waits for
    /// place `follows` of its key.
    Defer {
        /// The place it waits for.
        follows: i64,
        /// The first wait tier.
        delay: Duration,
        /// Its deferrals, this one included.
        deferrals: u32,
    },
}
