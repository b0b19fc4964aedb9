//! Whether a row's message would reach every queue the topology binds to it (decision 0030).
//!
//! The broker returns a `mandatory` message only when no queue takes it. A cancelled order's
//! `order.ended` goes to inventory and to billing: with inventory's queue missing (a first deploy
//! where inventory has not started, a queue being moved), billing takes it, nothing is returned,
//! and inventory never hears of the order's end. So before a row is published, the relay looks up
//! its exchange and each queue that the expected topology binds to its routing key
//! ([`topology::Topology::queues_for`]), and holds the row while one is missing: it stays
//! unpublished with the reason in `last_error`, is claimed again after a backoff, and
//! `outbox_topology_missing` counts what is missing. A missing exchange is declared if the
//! relay's user may (a developer's broker); an exchange the topology does not name is not waited
//! for: if it cannot be declared, the broker refuses the publish and the row is parked as any row
//! the broker refuses.
//!
//! An answer, present or missing, is trusted for [`TRUSTED_FOR`]; a channel the broker closes
//! clears them. Each lookup has the confirm deadline: a broker that stops reading the connection
//! (a resource alarm) ends the session as an overdue confirm does.
//!
//! Not seen: a binding removed by hand from a queue that still exists (AMQP cannot look one up;
//! the deploy step, `msgctl topology apply`, binds every endpoint again), and a queue deleted
//! within [`TRUSTED_FOR`] of its last lookup.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use messaging::{outbox_relay::OutboxRow, publisher::PublishError, runtime::metrics::OutboxMetrics, topology};

/// How long an answer about an exchange or a queue is trusted before it is looked up again.
pub const TRUSTED_FOR: Duration = Duration::from_secs(5);

/// What is looked up: the broker names exchanges and queues apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Exchange,
    Queue,
}

/// Whether a name was there when looked up, and when.
type Answers = HashMap<String, (bool, Instant)>;

/// What one relay session has looked up on its broker connection.
pub struct Reach<'a> {
    connection: &'a lapin::Connection,
    expected: &'a topology::Topology,
    metrics: &'a OutboxMetrics,
    /// How long a lookup may take (`CONFIRM_TIMEOUT`).
    deadline: Duration,
    /// Each exchange looked up.
    exchanges: Answers,
    /// Each queue looked up.
    queues: Answers,
    /// The queues bound to each routing key met so far, by exchange: looked up by reference, so
    /// that a row whose key was met before costs no allocation.
    bound: HashMap<String, HashMap<String, Arc<[&'static str]>>>,
}

impl<'a> Reach<'a> {
    /// Nothing looked up yet, and `outbox_topology_missing` at 0 until something is.
    pub fn new(
        connection: &'a lapin::Connection,
        expected: &'a topology::Topology,
        metrics: &'a OutboxMetrics,
        deadline: Duration,
    ) -> Self {
        metrics.topology_missing(0);
        let (exchanges, queues, bound) = (HashMap::new(), HashMap::new(), HashMap::new());
        Self { connection, expected, metrics, deadline, exchanges, queues, bound }
    }

    /// Forget every answer: the broker closed a channel, and may have lost something.
    pub fn forget(&mut self) {
        self.exchanges.clear();
        self.queues.clear();
    }

    /// Why `row` must wait, if it must: an exchange of the topology, or a queue it binds to the
    /// row's routing key, does not exist.
    pub async fn hold_reason(&mut self, row: &OutboxRow) -> Result<Option<String>, PublishError> {
        let exchange = row.exchange.as_str();
        // The default exchange and the broker's own always exist, and cannot be looked up.
        let builtin = exchange.is_empty() || exchange.starts_with("amq.");
        if !builtin && !self.is_present(Kind::Exchange, exchange).await? && self.expected.exchanges.contains(&exchange)
        {
            return Ok(Some(format!(
                "held: exchange `{exchange}` of the topology does not exist; the topology's deploy step declares it \
                 (`msgctl topology apply`)"
            )));
        }
        let expected = self.bound_to(exchange, &row.routing_key);
        let mut missing = Vec::new();
        for queue in expected.iter() {
            if !self.is_present(Kind::Queue, queue).await? {
                missing.push(*queue);
            }
        }
        if missing.is_empty() {
            return Ok(None);
        }
        Ok(Some(format!(
            "held: `{}` on `{exchange}` would reach {} of the {} queues the topology binds to it; missing: {}. The \
             topology's deploy step declares them (`msgctl topology apply`)",
            row.routing_key,
            expected.len() - missing.len(),
            expected.len(),
            missing.join(", "),
        )))
    }

    /// Set `outbox_topology_missing` to what was found missing lately: within the longest wait
    /// of a held row (`stale_after`), so that the count falls once nothing is held for it (the
    /// rows published, or discarded).
    pub fn report(&self, stale_after: Duration) {
        let fresh = stale_after + TRUSTED_FOR;
        let answers = self.exchanges.values().chain(self.queues.values());
        let missing = answers.filter(|(present, at)| !present && at.elapsed() < fresh).count();
        self.metrics.topology_missing(missing);
    }

    /// Whether `name` exists: the trusted answer, or a passive declare on a channel of its own,
    /// within the deadline (RabbitMQ 4.3 answers one only to a user with some permission on the
    /// name: `ops/rabbitmq/users.sh` gives the relay write on the work queues). A missing exchange
    /// is declared, if the relay's user may.
    async fn is_present(&mut self, kind: Kind, name: &str) -> Result<bool, PublishError> {
        if let Some((present, at)) = self.answers(kind).get(name)
            && at.elapsed() < TRUSTED_FOR
        {
            return Ok(*present);
        }
        let names = [name];
        let lookup = async {
            match kind {
                Kind::Exchange => match topology::ensure_exchanges(self.connection, &names).await {
                    Ok(()) => Ok(true),
                    Err(error) if topology::is_access_refused(&error) => Ok(false),
                    Err(error) => Err(error),
                },
                Kind::Queue => Ok(topology::missing_queues(self.connection, &names).await?.is_empty()),
            }
        };
        let present =
            tokio::time::timeout(self.deadline, lookup).await.map_err(|_| PublishError::TimedOut(self.deadline))??;
        self.answers(kind).insert(name.to_owned(), (present, Instant::now()));
        Ok(present)
    }

    fn answers(&mut self, kind: Kind) -> &mut Answers {
        match kind {
            Kind::Exchange => &mut self.exchanges,
            Kind::Queue => &mut self.queues,
        }
    }

    /// The queues the topology binds to `routing_key` on `exchange`, worked out once per key.
    fn bound_to(&mut self, exchange: &str, routing_key: &str) -> Arc<[&'static str]> {
        if let Some(queues) = self.bound.get(exchange).and_then(|keys| keys.get(routing_key)) {
            return Arc::clone(queues);
        }
        let queues: Arc<[&'static str]> = self.expected.queues_for(exchange, routing_key).into();
        self.bound.entry(exchange.to_owned()).or_default().insert(routing_key.to_owned(), Arc::clone(&queues));
        queues
    }
}
