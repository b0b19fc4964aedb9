//! The consumer runtime (`docs/guarantees.md`, the failure matrix). A service writes a
//! [`Handle<C>`](messaging_core::handler::Handle) for each contract its endpoint accepts, gathered in
//! [`Routes`](messaging_core::handler::Routes) (or one raw [`Handler`]); the runtime does the rest, once,
//! for every endpoint:
//!
//! 1. manual acks and a bounded prefetch. Ready deliveries are applied in batches of up to
//!    `BATCH_SIZE`, one transaction and one ack per batch, one batch at a time; if anything in a
//!    batch fails, its messages are applied again one by one, so that each outcome below is what
//!    it would be alone (decision 0008). With `BATCH_SIZE=1`, each delivery has its own
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
//!    again (`ordering`), spending no attempt;
//! 9. a consumer with nothing in flight for `idle_renewal` opens its channels again, so that a
//!    delivery the broker counts as its own but never sent it (a quorum queue's leader change can
//!    lose one so) comes back, redelivered.
//!
//! Its parts: `machine`, free of I/O, decides what to start next and what becomes of each
//! delivery (the table above; decision 0035): one per session, fed what happens and polled for
//! what to do. `session` does the broker I/O around it, on one connection to consume and one to
//! publish, and runs each of its actions as an effect: `settle` has the effects (count a start,
//! apply, settle), `apply` runs the transaction, `park` and `ordering` publish retry, parked and
//! deferred copies, and `acks` is the one place a delivery is acked: it cannot be acked twice,
//! nor before its outcome is durable.

mod acks;
mod apply;
mod args;
mod crashes;
mod machine;
mod ordering;
mod park;
mod probe;
mod session;
mod settle;

pub use args::{ConsumerArgs, LATE_COPY_MARGIN};

use std::{sync::Arc, time::Duration};

use messaging_core::handler::{Handler, HandlerError};
use sqlx::PgPool;
use tracing::Instrument;

use crate::{
    runtime::{
        backoff::Backoff,
        broker::{self, Link},
        config::{BrokerArgs, BrokerNodes},
        db,
        health::Health,
        metrics::EndpointMetrics,
        shutdown::Shutdown,
    },
    topology::{Endpoint, RetryPolicy},
};

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
    /// How long the consumers may idle (nothing in flight) before their channels are opened
    /// again (`IDLE_RENEWAL`), handing back a delivery the broker lost on its way to them; `None`,
    /// never.
    pub idle_renewal: Option<Duration>,
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
            idle_renewal: Some(args.idle_renewal).filter(|period| !period.is_zero()),
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
    mut settings: ConsumerSettings,
    handler: Arc<H>,
    pool: PgPool,
    health: Health,
    shutdown: Shutdown,
) {
    // What the handler's routes take, the endpoint accepts too: a service lists its contracts
    // once, in its routes, and its topology binds them (`Endpoint::bind_contract`).
    let name = settings.endpoint.name;
    for (message_type, version) in handler.accepts() {
        match settings.endpoint.accepts.iter().find(|(accepted, _)| *accepted == message_type) {
            None => settings.endpoint.accepts.push((message_type, version)),
            Some((_, accepted)) => assert_eq!(
                *accepted, version,
                "{name} accepts {message_type} up to major version {accepted}, its route up to {version}"
            ),
        }
    }
    let accepts: Vec<&str> = settings.endpoint.accepts.iter().map(|(accepted, _)| *accepted).collect();
    if let Err(mismatch) = handler.check_routes(&accepts) {
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
    let prune = crate::retention::run("inbox", shutdown.clone(), {
        let pool = pool.clone();
        move || {
            let pool = pool.clone();
            async move { crate::retention::delete_received_before(&pool, retention, crate::retention::BATCH).await }
        }
    });
    let metrics = health.metrics.endpoint(name);
    let rules = machine::Rules {
        policy: settings.policy.clone(),
        max_crashes: settings.max_crashes,
        reconnect: settings.reconnect,
        draw: fastrand::f64,
    };
    let flag = link.name.clone();
    let kept = db::Kept::new(pool.clone());
    let mut runtime = Arc::new(Runtime { settings, rules, handler, pool, kept, health, metrics, flag, shutdown });
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
    rules: machine::Rules,
    handler: Arc<H>,
    pool: PgPool,
    /// The connection its messages' transactions run on, kept between them.
    kept: db::Kept,
    health: Health,
    /// Its endpoint's series, looked up once.
    metrics: EndpointMetrics,
    /// The readiness flag of its link.
    flag: String,
    shutdown: Shutdown,
}

/// The time the consumer's decisions are told: the runtime's clock (paused in a test that pauses
/// it), as a plain instant.
fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}
