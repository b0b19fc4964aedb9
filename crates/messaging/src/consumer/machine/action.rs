use std::time::Duration;

use messaging_core::handler::Reason;

use super::{LedgerEntry, Settlement, Tag};

/// What the [`Machine`](super::Machine) asks the session to do. Each but [`Action::Wait`] is an
/// effect whose end the session feeds back as an [`Input`](super::Input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::consumer) enum Action {
    /// Commit one more start of the delivery in the crash ledger; answer
    /// [`Input::Started`](super::Input::Started).
    CountStart(Tag),
    /// Run its transaction (inbox row, turn, handler, commit); answer
    /// [`Input::Applied`](super::Input::Applied).
    Apply(Tag),
    /// Run these deliveries' transactions as one, and ack them all if it commits; answer
    /// [`Input::BatchApplied`](super::Input::BatchApplied).
    ApplyBatch(Vec<Tag>),
    /// The database cannot work now: the delivery waits `delay` before its next try. It counts as
    /// held for its database from its first wait until it is settled.
    Wait {
        /// The delivery.
        tag: Tag,
        /// How long, from the reconnect backoff.
        delay: Duration,
        /// What the database answered.
        error: Reason,
    },
    /// Settle the delivery as decided (ack; publish a copy, then ack; or hand it back), and
    /// forget its start in the crash ledger as `ledger` says; answer
    /// [`Input::Settled`](super::Input::Settled).
    Settle {
        /// The delivery.
        tag: Tag,
        /// How it leaves.
        settlement: Settlement,
        /// What becomes of its start in the crash ledger.
        ledger: LedgerEntry,
    },
}
