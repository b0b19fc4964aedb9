//! Whether a row's message would reach every queue the topology binds to it (decision 0030).
//!
//! The broker returns a `mandatory` message only when no queue takes it. `order.ended` goes to
//! inventory and to billing: with inventory's queue missing (a first deploy where inventory has
//! not started, a queue being moved), billing takes it, nothing is returned, and inventory never
//! hears of the order's end. So before a row is published, the relay looks up its exchange and
//! each queue that the expected topology binds to its routing key
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
    time::{Duration, Instant},
};

use messaging::{outbox_relay::OutboxRow, publisher::PublishError, runtime::metrics::OutboxMetrics, topology};

/// How long an answer about an exchange or a queue is trusted before it is looked up again.
pub const TRUSTED_FOR: Duration = Duration::from_secs(5);

/// What is looked up: the broker names exchanges and queues apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Exchange,
    Queue,
}

/// What one relay session has looked up on its broker connection.
pub struct Reach<'a> {
    connection: &'a lapin::Connection,
    expected: &'a topology::Topology,
    metrics: &'a OutboxMetrics,
    /// How long a lookup may take (`CONFIRM_TIMEOUT`).
    deadline: Duration,
    /// Each exchange and queue looked up: whether it was there, and when.
    known: HashMap<(Kind, String), (bool, Instant)>,
    /// The queues bound to each (exchange, routing key) met so far.
    bound: HashMap<(String, String), Vec<&'static str>>,
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
        Self { connection, expected, metrics, deadline, known: HashMap::new(), bound: HashMap::new() }
    }

    /// Forget every answer: the broker closed a channel, and may have lost something.
    pub fn forget(&mut self) {
        self.known.clear();
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
        let key = (row.exchange.clone(), row.routing_key.clone());
        let expected = match self.bound.get(&key) {
            Some(queues) => queues.clone(),
            None => self.bound.entry(key).or_insert(self.expected.queues_for(exchange, &row.routing_key)).clone(),
        };
        let mut missing = Vec::new();
        for queue in &expected {
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
        let missing = self.known.values().filter(|(present, at)| !present && at.elapsed() < fresh).count();
        self.metrics.topology_missing(missing);
    }

    /// Whether `name` exists: the trusted answer, or a passive declare on a channel of its own,
    /// within the deadline (RabbitMQ 4.3 answers one only to a user with some permission on the
    /// name: `ops/rabbitmq/users.sh` gives the relay write on the work queues). A missing exchange is declared,
    /// if the relay's user may.
    async fn is_present(&mut self, kind: Kind, name: &str) -> Result<bool, PublishError> {
        let key = (kind, name.to_owned());
        if let Some((present, at)) = self.known.get(&key)
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
        self.known.insert(key, (present, Instant::now()));
        Ok(present)
    }
}
