//! What a service writes: a handler applies one message inside the runtime's transaction, and says
//! how it failed ([`HandlerError`]). [`Handle<C>`] is a handler of one contract, [`Routes`] gathers
//! them for an endpoint.

mod routes;

pub use routes::{Context, Handle, LockBatch, Routes};

use std::{future::Future, sync::Arc};

use sqlx::PgConnection;

use crate::envelope::{Incoming, Unreadable};

/// How a handler failed. Business refusals are not errors: they commit an outcome like any result.
/// Each kind carries its [`Reason`]: the text a retry or a parked message records, and the error
/// behind it, if any ([`std::error::Error::source`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandlerError {
    /// The database cannot be reached, or the node reached refuses writes (a failover): not the
    /// message's fault, so no attempt is spent. The runtime keeps the delivery and applies it
    /// again, with backoff, until the database takes it.
    Unavailable(Reason),
    /// Might work later (a deadlock, a serialization failure, a flaky dependency): retry after a
    /// wait, spending an attempt.
    Transient(Reason),
    /// Will never work (a bug, a message we cannot make sense of): park now.
    Permanent(Reason),
}

impl HandlerError {
    /// Why: the text recorded, and the error behind it.
    pub fn reason(&self) -> &Reason {
        match self {
            Self::Unavailable(reason) | Self::Transient(reason) | Self::Permanent(reason) => reason,
        }
    }
}

impl std::fmt::Display for HandlerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unavailable(reason) => write!(f, "database unavailable: {reason}"),
            Self::Transient(reason) | Self::Permanent(reason) => write!(f, "{reason}"),
        }
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.reason().cause().map(|cause| cause as &(dyn std::error::Error + 'static))
    }
}

/// Why a handler failed: a text, and the error that caused it when there was one (kept whole, so
/// that a caller can inspect or downcast it). Two reasons are equal when their texts are.
///
/// ```
/// use messaging_core::handler::{HandlerError, Reason};
///
/// let refused = HandlerError::Permanent(Reason::new("no price for SKU-9"));
/// assert_eq!(refused.to_string(), "no price for SKU-9");
///
/// let lost = HandlerError::from(sqlx::Error::PoolTimedOut);
/// let cause = lost.reason().cause().expect("the sqlx error is kept");
/// assert!(matches!(cause.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::PoolTimedOut)));
/// ```
#[derive(Debug, Clone)]
pub struct Reason {
    text: String,
    cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl Reason {
    /// A reason of its own, with no error behind it.
    pub fn new(text: impl Into<String>) -> Self {
        Self { text: text.into(), cause: None }
    }

    /// `cause`'s own words, and `cause` kept.
    pub fn caused_by(cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self { text: cause.to_string(), cause: Some(Arc::new(cause)) }
    }

    /// The text recorded.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The error behind it, if any.
    pub fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.cause.as_deref()
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl PartialEq for Reason {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Reason {}

impl From<String> for Reason {
    fn from(text: String) -> Self {
        Self::new(text)
    }
}

impl From<&str> for Reason {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<sqlx::Error> for HandlerError {
    /// An unreachable database, or one that refuses writes (a standby, a demoted primary: see
    /// [`crate::outage::is_wrong_node`]), or one that cannot work now (out of disk, memory or
    /// connections: [`crate::outage::cannot_now`]), is `Unavailable`; transaction conflicts, a lock
    /// waited for too long, a statement cancelled and a garbled connection are transient; anything
    /// the database rejects on its merits (a constraint, a type) would fail the same way again, so
    /// it is permanent.
    fn from(error: sqlx::Error) -> Self {
        if crate::outage::is_unreachable(&error) {
            return Self::Unavailable(Reason::caused_by(error));
        }
        let transient = match &error {
            sqlx::Error::Database(e) => e.code().is_some_and(|code| transient_sqlstate(&code)),
            sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) => true,
            _ => false,
        };
        let reason = Reason::caused_by(error);
        if transient { Self::Transient(reason) } else { Self::Permanent(reason) }
    }
}

/// Whether a statement that failed with `code` may succeed if tried again: class 40 (rollback:
/// serialization failure, deadlock), 57 (operator intervention, e.g. a cancelled statement; the
/// shutdown codes are `Unavailable`, as is most of class 53, insufficient resources), 53400 (a
/// configured limit such as `temp_file_limit`), and 55P03, `lock_not_available`:
/// `lock_timeout` (`DB_LOCK_TIMEOUT`) expired behind another transaction's lock. Two consumers of
/// one queue wait on each other's rows; parking the second after one wait was a bug the cluster
/// soak found (three orders quarantined in 20,000).
fn transient_sqlstate(code: &str) -> bool {
    matches!(code.get(..2), Some("40" | "57")) || matches!(code, "55P03" | "53400")
}

impl From<Unreadable> for HandlerError {
    fn from(error: Unreadable) -> Self {
        Self::Permanent(Reason::caused_by(error))
    }
}

/// What a service implements: apply one message inside the runtime's transaction. The inbox row
/// is already written in `tx`; the handler adds its effect and any outbox rows, and must not
/// commit. Returning an error rolls everything back, inbox row included.
pub trait Handler: Send + Sync + 'static {
    /// Apply `message`.
    fn handle(
        &self,
        message: &Incoming,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Before the messages of a batch (decision 0008) are handled one by one in its transaction:
    /// take at once, in one consistent order, the row locks their handlers will take one message
    /// at a time. Of two batches in flight together (two instances of a consumer), one then waits
    /// for the other, instead of each holding a row the other needs: a deadlock, which would cost
    /// both a second's wait (`deadlock_timeout`) and one of them a retry. `messages` are the
    /// batch's members the inbox had not seen. A message handled alone (a redelivery, a batch's
    /// fallback, batching off) is not asked: its handler's own locks must come in the same order.
    /// The default takes nothing: right for a handler whose messages lock rows no other message
    /// of the queue locks.
    fn lock_batch(
        &self,
        messages: &[&Incoming],
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        let _ = (messages, tx);
        async { Ok(()) }
    }

    /// The types it handles, each up to its current major version, when it knows them ([`Routes`]
    /// does): the consumer accepts them besides what its endpoint accepts, so that a service's
    /// contracts are listed once, in its routes. None by default.
    fn accepts(&self) -> Vec<(&'static str, u32)> {
        Vec::new()
    }

    /// Whether it handles every type its endpoint accepts (`accepts`), when it can tell ([`Routes`]
    /// can): checked once before consuming, since a type with no handler is a bug in the service.
    fn check_routes(&self, _accepts: &[&str]) -> Result<(), String> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::HandlerError;

    #[test]
    fn database_errors_are_classified_by_whose_fault_they_are() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(matches!(HandlerError::from(sqlx::Error::Io(refused)), HandlerError::Unavailable(_)));
        assert!(matches!(HandlerError::from(sqlx::Error::PoolTimedOut), HandlerError::Unavailable(_)));
        assert!(matches!(HandlerError::from(sqlx::Error::Protocol("garbled".into())), HandlerError::Transient(_)));
        assert!(matches!(HandlerError::from(sqlx::Error::RowNotFound), HandlerError::Permanent(_)));
    }

    #[test]
    fn a_lock_waited_for_too_long_is_worth_another_try_and_a_constraint_is_not() {
        use super::transient_sqlstate;
        for code in ["40001", "40P01", "57014", "55P03", "53400"] {
            assert!(transient_sqlstate(code), "{code}");
        }
        for code in ["23505", "22P02", "55000", "55006", "42P01"] {
            assert!(!transient_sqlstate(code), "{code}");
        }
    }
}
