/// A redelivery's start in the crash ledger, and when it is forgotten. Once the delivery leaves
/// this process alive (settled, or handed back: a copy not confirmed, an ack that failed, the
/// session's end), its start was no crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::consumer) enum LedgerEntry {
    /// Not counted (a first delivery, or a session that ended before the ledger answered).
    NotCounted,
    /// Forgotten whatever way the delivery leaves.
    Forget,
    /// Parked for crashing its consumer: forgotten only once the parked copy is confirmed and the
    /// delivery acked. If it is not (the copy refused, or the delivery left unacked when the
    /// session ended first), the count stays, and when the delivery comes back it is parked at
    /// once instead of crashing its consumer again.
    ForgetOnceParked,
}
