/// The outcome of the transaction for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::consumer) enum Applied {
    Done,
    Duplicate,
    /// Rolled back, nothing applied: its endpoint is ordered by key, and the key has not passed
    /// place `follows`, the earlier message this one waits for.
    Waits {
        follows: i64,
    },
}
