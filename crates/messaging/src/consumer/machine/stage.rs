use std::time::Instant;

use super::Attempt;

/// Where a tracked delivery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Received, not started yet (or waiting its turn in a batch's fallback).
    Queued,
    /// An attempt of its own is running.
    Trying,
    /// Its batch's transaction is running.
    InBatch,
    /// The database could not work: `again` is tried at `until`.
    WaitingOut {
        /// The end of the wait.
        until: Instant,
        /// What is tried then.
        again: Attempt,
    },
    /// Its settlement is running.
    Settling,
}
