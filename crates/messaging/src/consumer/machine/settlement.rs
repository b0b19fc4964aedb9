use super::{Applied, Republish};

/// How a delivery leaves this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::consumer) enum Settlement {
    /// Ack it: its transaction committed, or the inbox had seen it.
    Ack(Applied),
    /// Publish a copy, then ack: held beside the session's work, where a broker blocking
    /// publishers holds it and not the deliveries behind.
    Republish(Republish),
    /// Leave it unacked: the broker redelivers it when the channel closes.
    HandBack,
}
