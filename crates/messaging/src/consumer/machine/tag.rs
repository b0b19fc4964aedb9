/// A work-queue delivery's name in the machine: its delivery tag on the session's work channel,
/// unique for the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(in crate::consumer) struct Tag(pub(in crate::consumer) u64);
