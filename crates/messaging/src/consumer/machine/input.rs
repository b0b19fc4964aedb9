use messaging_core::handler::HandlerError;

use super::{Applied, Arrival, Tag};

/// What happened in the session, fed to the [`Machine`](super::Machine).
#[derive(Debug)]
pub(in crate::consumer) enum Input {
    /// A delivery came from the work queue: what is known of it, and why it cannot be read, if so.
    Delivered {
        /// Its name.
        tag: Tag,
        /// Read from its properties.
        arrival: Arrival,
        /// Why it cannot be read (no id, an unknown type or major version): it is parked at once.
        unreadable: Option<String>,
    },
    /// The session started parking what the broker dead-lettered, a task of its own: a
    /// redelivery waits for it too.
    DeadLettered,
    /// That task finished.
    DeadLetterParked,
    /// The crash ledger's count of starts of the delivery, this one included.
    Started {
        /// The delivery.
        tag: Tag,
        /// The count, or why there is none.
        starts: Result<u32, HandlerError>,
    },
    /// Its transaction's outcome.
    Applied {
        /// The delivery.
        tag: Tag,
        /// The outcome.
        applied: Result<Applied, HandlerError>,
    },
    /// The batch's transaction: committed and its deliveries acked (or their ack failed, and the
    /// session ends), or not applied at all (then each is applied again on its own).
    BatchApplied {
        /// Whether it committed.
        committed: bool,
    },
    /// The delivery was settled as asked (or failed to be: the session then ends), and has left.
    Settled(Tag),
    /// The effects for these deliveries panicked: they leave unsettled, their starts counted.
    Panicked(Vec<Tag>),
    /// The session ended (shutdown, its connection lost, a settlement that failed). Deliveries
    /// waiting for the database are handed back; those being applied or settled finish.
    SessionEnded,
}
