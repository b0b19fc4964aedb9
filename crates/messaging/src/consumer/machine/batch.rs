use std::collections::{BTreeSet, VecDeque};

use super::Tag;

/// The batch in flight: one slot for all its deliveries, until the last of them has left.
#[derive(Debug, Default)]
pub(super) struct Batch {
    /// Its deliveries that have not left yet.
    pub(super) out: BTreeSet<Tag>,
    /// After its transaction failed: its readable deliveries still to go one by one, in order
    /// (decision 0008).
    pub(super) rest: VecDeque<Tag>,
    /// The one going now, of those.
    pub(super) going: Option<Tag>,
}
