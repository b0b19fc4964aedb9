//! Whether a row's message would reach every queue the topology binds to it (decision 0030).
//!
//! The broker returns a `mandatory` message only when no queue takes it. `order.ended` goes to
//! inventory and to billing: with inventory's queue missing (a first deploy where inventory has
//! not started, a queue being moved), billing takes it, nothing is returned, and inventory never
//! hears of the order's end. So before a row is published, the relay looks up its exchange and
//! each queue that the expected topology binds to its routing key
//! ([`topology::Topology::queues_for`]), and holds the row while one is missing: it stays
//! unpublished with the reason in `last_error`, is claimed again after a backoff, and
//! `outbox_topology_missing` counts what is missing. What it found present it trusts for
//! [`TRUSTED_FOR`]; a channel the broker closes clears that.
//!
//! A binding cannot be looked up over AMQP: a queue that exists without its binding (unbound by
//! hand) is not seen. The deploy step (`msgctl topology apply`) binds every endpoint again.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use messaging::{outbox_relay::OutboxRow, runtime::metrics::OutboxMetrics, topology};

/// How long an exchange or queue found present is trusted before it is looked up again.
pub const TRUSTED_FOR: Duration = Duration::from_secs(5);

/// What one relay session has looked up on its broker connection.
pub struct Reach<'a> {
    connection: &'a lapin::Connection,
    expected: &'a topology::Topology,
    metrics: &'a OutboxMetrics,
    /// Exchanges and queues found present, and when.
    present: HashMap<String, Instant>,
    /// Exchanges and queues found missing and not found since: `outbox_topology_missing`.
    missing: HashSet<String>,
    /// The queues bound to each (exchange, routing key) met so far.
    bound: HashMap<(String, String), Vec<&'static str>>,
}

impl<'a> Reach<'a> {
    /// Nothing looked up yet.
    pub fn new(
        connection: &'a lapin::Connection,
        expected: &'a topology::Topology,
        metrics: &'a OutboxMetrics,
    ) -> Self {
        Self { connection, expected, metrics, present: HashMap::new(), missing: HashSet::new(), bound: HashMap::new() }
    }

    /// Forget what was found present: the broker closed a channel, and may have lost something.
    pub fn forget(&mut self) {
        self.present.clear();
    }

    /// Why `row` must wait, if it must: its exchange does not exist (and this relay may not
    /// declare it), or a queue the topology binds to its routing key does not.
    pub async fn hold_reason(&mut self, row: &OutboxRow) -> lapin::Result<Option<String>> {
        let exchange = row.exchange.as_str();
        if !self.is_trusted(exchange) {
            match topology::ensure_exchanges(self.connection, &[exchange]).await {
                Ok(()) => self.found(exchange, true),
                Err(error) if topology::is_access_refused(&error) => {
                    self.found(exchange, false);
                    return Ok(Some(format!(
                        "held: exchange `{exchange}` does not exist, and the relay's broker user may not declare it; \
                         the topology's deploy step declares it (`msgctl topology apply`)"
                    )));
                }
                Err(error) => return Err(error),
            }
        }
        let key = (row.exchange.clone(), row.routing_key.clone());
        let expected = match self.bound.get(&key) {
            Some(queues) => queues.clone(),
            None => self.bound.entry(key).or_insert(self.expected.queues_for(exchange, &row.routing_key)).clone(),
        };
        let unknown: Vec<&str> = expected.iter().copied().filter(|queue| !self.is_trusted(queue)).collect();
        if unknown.is_empty() {
            return Ok(None);
        }
        let missing = topology::missing_queues(self.connection, &unknown).await?;
        for queue in &unknown {
            self.found(queue, !missing.contains(queue));
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

    fn is_trusted(&self, name: &str) -> bool {
        self.present.get(name).is_some_and(|at| at.elapsed() < TRUSTED_FOR)
    }

    fn found(&mut self, name: &str, present: bool) {
        if present {
            self.present.insert(name.to_owned(), Instant::now());
            self.missing.remove(name);
        } else {
            self.present.remove(name);
            self.missing.insert(name.to_owned());
        }
        self.metrics.topology_missing(self.missing.len());
    }
}
