/// Something tried on the database, whose outcome is reported back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::consumer) enum Attempt {
    /// Commit one more start of the message in the crash ledger, and report the count.
    CountStart,
    /// Run its transaction (inbox row, turn, handler, commit), and report its outcome.
    Apply,
}
