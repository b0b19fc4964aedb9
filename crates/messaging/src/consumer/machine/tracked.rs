use super::{Arrival, Stage, decision::Decision};

/// A delivery the machine tracks, from its arrival until it leaves.
#[derive(Debug)]
pub(super) struct Tracked {
    /// What is known of it.
    pub(super) arrival: Arrival,
    /// Why it cannot be read, if so.
    pub(super) unreadable: Option<String>,
    /// Its way through the decision table.
    pub(super) decision: Decision,
    /// Where it is.
    pub(super) stage: Stage,
    /// Scheduled by the queue: it holds a slot of its own ([`Self::own_slot`]) or its batch's.
    pub(super) scheduled: bool,
    /// It holds a slot of its own (a redelivery alone, or one delivery beside others with
    /// batching off), rather than its batch's.
    pub(super) own_slot: bool,
}
