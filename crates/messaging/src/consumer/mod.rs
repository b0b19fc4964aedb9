//! The consumer runtime (`docs/guarantees.md`, the failure matrix). A service writes a
//! [`Handle<C>`] for each contract its endpoint accepts, gathered in [`Routes`] (or one raw
//! [`Handler`]); the runtime does the rest, once, for every endpoint:
//!
//! 1. manual acks and a bounded prefetch. Ready deliveries are applied in batches of up to
//!    `BATCH_SIZE`, one transaction and one ack per batch, one batch at a time; if anything in a
//!    batch fails, its messages are applied again one by one, so that each outcome below is what
//!    it would be alone (decision 0008). With `BATCH_SIZE=1`, each delivery has its own task and
//!    transaction, up to the prefetch at once;
//! 2. a delivery without a readable `message_id`, or of an unknown type or major version, is
//!    parked at once;
//! 3. otherwise one transaction records the message in the inbox, runs the handler and commits;
//!    only then is the delivery acked. A message the inbox has seen is acked without effect;
//! 4. a transient error re-publishes a copy to the next wait tier with `retry-count + 1`
//!    (confirmed), then acks the original; the last allowed attempt, or a permanent error, parks
//!    the message with its reason (confirmed), then acks. Both emit a `job.*` event. Such a
//!    settlement publishes on a connection of the session's own and is held beside its other work,
//!    so that a broker blocking publishers (a resource alarm) holds only these. An
//!    unreachable database is not the message's fault: the delivery is held and applied again
//!    with backoff until the database answers, spending no attempt (decision 0003);
//! 5. there is no `nack(requeue = true)` for a failure: a message that fails never spins. Only
//!    shutdown and lost connections leave deliveries unacked, and the broker redelivers those;
//! 6. a redelivery (the broker's `redelivered` flag) may be the message that crashed the last
//!    process, so it runs alone, with its start committed first to the crash ledger
//!    (the crash ledger, `crashes`). A message that keeps killing its consumer is parked once it has
//!    started `max_crashes` times alone without finishing; the messages prefetched beside it lose
//!    nothing (decision 0005). A handler that hangs is abandoned after `handler_timeout`;
//! 7. what the broker itself dead-letters (its delivery limit, a last resort) arrives in the
//!    endpoint's intake queue and is parked with the broker's reason and a job event, like any
//!    other parked message;
//! 8. on an endpoint ordered by key, a message that arrives before the earlier one of its key it
//!    follows (of a type the endpoint takes) has been applied is rolled back and sent to wait
//!    again (`ordering`), spending no attempt.
//!
//! Its parts, two of them free of I/O: `scheduler` decides what to start next, and `decide` what
//! becomes of each delivery (the table above, with its tests). `session` does the broker I/O
//! around the scheduler, `settle` performs what `decide` says, `apply` runs the transaction,
//! `park` and `ordering` publish retry, parked and deferred copies, and `acks` is the one place a
//! delivery is acked: it cannot be acked twice, nor before its outcome is durable.

mod acks;
mod apply;
mod crashes;
mod decide;
mod ordering;
mod park;
mod probe;
mod scheduler;
mod session;
mod settle;
mod typed;

pub use typed::{Context, Handle, LockBatch, Routes};

use std::{future::Future, sync::Arc, time::Duration};

use sqlx::{PgConnection, PgPool};
use tracing::Instrument;

use crate::{
    envelope::{Incoming, Unreadable},
    runtime::{
        backoff::Backoff,
        broker::{self, Link},
        config::{BrokerArgs, BrokerNodes, ConsumerArgs},
        health::Health,
        metrics::{EndpointMetrics, Handling},
        shutdown::Shutdown,
    },
    topology::{Endpoint, RetryPolicy},
};

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
/// use messaging::consumer::{HandlerError, Reason};
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
    /// [`crate::runtime::db::is_wrong_node`]), is `Unavailable`; transaction conflicts, a lock waited for too
    /// long, resource limits and a garbled connection are transient; anything the database
    /// rejects on its merits (a constraint, a type) would fail the same way again, so it is
    /// permanent.
    fn from(error: sqlx::Error) -> Self {
        if crate::runtime::db::is_unreachable(&error) {
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
/// serialization failure, deadlock), 53 (insufficient resources), 57 (operator intervention, e.g. a
/// cancelled statement; the shutdown codes are `Unavailable`), and 55P03, `lock_not_available`:
/// `lock_timeout` (`DB_LOCK_TIMEOUT`) expired behind another transaction's lock. Two consumers of
/// one queue wait on each other's rows; parking the second after one wait was a bug the cluster
/// soak found (three orders quarantined in 20,000).
fn transient_sqlstate(code: &str) -> bool {
    matches!(code.get(..2), Some("40" | "53" | "57")) || code == "55P03"
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

    /// Whether it handles exactly the types `endpoint` accepts, when it can tell ([`Routes`]
    /// can): checked once before consuming, since a mismatch is a bug in the service.
    fn check_routes(&self, _endpoint: &Endpoint) -> Result<(), String> {
        Ok(())
    }
}

/// Everything a consumer needs besides its handler.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// The endpoint it consumes.
    pub endpoint: Endpoint,
    /// Retry tiers and attempt cap.
    pub policy: RetryPolicy,
    /// Unacked deliveries at once (and, without batching, handled concurrently).
    pub prefetch: u16,
    /// How deliveries are grouped into transactions.
    pub batch: Batching,
    /// The broker's nodes.
    pub amqp_url: BrokerNodes,
    /// Between reconnects (and between tries while the database is unreachable).
    pub reconnect: Backoff,
    /// Starts of a redelivered message, alone and never finished, before it is parked as the one
    /// crashing its consumer. Each is a process that died: a message is parked after at most
    /// `max_crashes + 1` crashes (the first may have been concurrent with others).
    pub max_crashes: u32,
    /// How long one handler transaction may run. A handler still running then is abandoned (its
    /// transaction rolls back): a database that answers a ping makes it a transient failure of the
    /// message, one that does not an outage (no attempt spent).
    pub handler_timeout: Duration,
    /// How long inbox rows are kept (`INBOX_RETENTION`): older ones are deleted hourly.
    pub inbox_retention: Duration,
    /// How long a retry, parked or job-event copy waits for its confirm (`CONFIRM_TIMEOUT`); past
    /// it the session ends and the delivery goes back to the broker unacked.
    pub confirm_timeout: Duration,
}

impl ConsumerSettings {
    /// Settings for `endpoint` from a binary's flags: its retry, prefetch, crash and timeout flags,
    /// its broker, and the default reconnect backoff.
    pub fn from_args(endpoint: Endpoint, args: &ConsumerArgs, broker: &BrokerArgs) -> Self {
        Self {
            endpoint: Endpoint { delivery_limit: args.delivery_limit, ..endpoint },
            policy: args.retry_policy(),
            prefetch: args.prefetch,
            batch: Batching { max_size: usize::from(args.batch_size), max_wait: args.batch_wait },
            amqp_url: broker.amqp_url.clone(),
            reconnect: Backoff::default(),
            max_crashes: args.max_crashes,
            handler_timeout: args.handler_timeout,
            inbox_retention: args.inbox_retention,
            confirm_timeout: broker.confirm_timeout,
        }
    }
}

/// Several ready deliveries applied in one transaction (one inbox row each, one commit, one
/// ack), one batch at a time. `max_size` 1 turns it off: each delivery is applied in its own
/// transaction, up to `prefetch` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// Deliveries per transaction, at most.
    pub max_size: usize,
    /// How long a batch that is not full waits for more before it starts.
    pub max_wait: Duration,
}

impl Batching {
    /// One delivery per transaction.
    pub const OFF: Self = Self { max_size: 1, max_wait: Duration::ZERO };

    fn on(&self) -> bool {
        self.max_size > 1
    }
}

/// The name of an endpoint's consumer in `/readyz` (and in the broker's management UI). A service
/// sets it not ready before it serves `/readyz`, so that a probe that comes before the consumer
/// has started is not answered "ready".
pub fn readiness_flag(endpoint: &Endpoint) -> String {
    format!("consumer:{}", endpoint.name)
}

/// Run a consumer until shutdown: connect, declare the endpoint's topology, consume; on a lost
/// connection, reconnect with backoff and resume. Never returns early on a broker or database
/// failure: those are waited out. Panics before connecting if the handler's routes do not fit
/// the endpoint ([`Handler::check_routes`]): that is a bug in the service, not a state to wait out.
pub async fn run<H: Handler>(
    settings: ConsumerSettings,
    handler: Arc<H>,
    pool: PgPool,
    health: Health,
    shutdown: Shutdown,
) {
    let name = settings.endpoint.name;
    if let Err(mismatch) = handler.check_routes(&settings.endpoint) {
        panic!("the handler of {name} does not fit its endpoint: {mismatch}");
    }
    assert!(
        !settings.endpoint.ordered_by_key || !settings.policy.delays().is_empty(),
        "{name} is ordered by key, so it needs a wait tier (RETRY_DELAYS) for messages that wait their turn"
    );
    let link = Link {
        nodes: settings.amqp_url.clone(),
        name: readiness_flag(&settings.endpoint),
        backoff: settings.reconnect,
        readiness: Arc::clone(&health.readiness),
    };
    let retention = settings.inbox_retention;
    let prune = crate::runtime::retention::run("inbox", shutdown.clone(), {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            async move { crate::inbox::delete_received_before(&pool, retention, crate::runtime::retention::BATCH).await }
        }
    });
    let metrics = health.metrics.endpoint(name);
    let rules = decide::Rules {
        policy: settings.policy.clone(),
        max_crashes: settings.max_crashes,
        reconnect: settings.reconnect,
    };
    let flag = link.name.clone();
    let mut runtime = Arc::new(Runtime { settings, rules, handler, pool, health, metrics, flag, shutdown });
    let shutdown = runtime.shutdown.clone();
    async {
        let pruning = tokio::spawn(prune.in_current_span());
        broker::run_sessions(&link, &shutdown, &mut runtime).await;
        let _ = pruning.await;
        tracing::info!("consumer stopped");
    }
    .instrument(tracing::info_span!("consumer", endpoint = name))
    .await;
}

struct Runtime<H> {
    settings: ConsumerSettings,
    /// What its decisions read of `settings`.
    rules: decide::Rules,
    handler: Arc<H>,
    pool: PgPool,
    health: Health,
    /// Its endpoint's series, looked up once.
    metrics: EndpointMetrics,
    /// The readiness flag of its link.
    flag: String,
    shutdown: Shutdown,
}

/// The outcome of the transaction for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applied {
    Done,
    Duplicate,
    /// Rolled back, nothing applied: its endpoint is ordered by key, and the key has not passed
    /// place `follows`, the earlier message this one waits for.
    Waits {
        follows: i64,
    },
}

impl Applied {
    /// How its transaction ended, for `message_handling_duration_seconds`.
    fn handling(self) -> Handling {
        match self {
            Self::Done => Handling::Succeeded,
            Self::Duplicate => Handling::Duplicate,
            Self::Waits { .. } => Handling::Deferred,
        }
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
        for code in ["40001", "40P01", "53300", "57014", "55P03"] {
            assert!(transient_sqlstate(code), "{code}");
        }
        for code in ["23505", "22P02", "55000", "55006", "42P01"] {
            assert!(!transient_sqlstate(code), "{code}");
        }
    }
}
