//! Broker topology (docs/architecture.md): topic exchanges and, per consuming endpoint, its work
//! queue, retry wait queues, parking queue, the intake of the broker's own dead letters, and a
//! direct exchange of its own through which its copies reach those queues. Declarations
//! are idempotent and take the same arguments on RabbitMQ 3.10 and 4.x (decision 0005); every queue
//! is a quorum queue, so messages survive a broker node restart.

use std::time::Duration;

use lapin::{
    Channel, Connection, ExchangeKind,
    options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions},
    protocol::{AMQPErrorKind, AMQPSoftError},
    types::{AMQPValue, FieldTable, ShortString},
};
use messaging_core::contracts::JOBS_EXCHANGE;

pub use messaging_core::endpoint::{Binding, DEFAULT_DELIVERY_LIMIT, Endpoint, Topology, direct_exchange_of};

/// The delivery limit of queues that must keep every message however often it is fetched and
/// returned (parking, and the intake of dead letters). Explicit, because RabbitMQ 4.x gives every
/// quorum queue a default limit of 20 and parking has nowhere to dead-letter to: a parked message
/// peeked 21 times would be dropped. Not `-1`: 4.x reads it as "unlimited" but 3.10 as "dead-letter
/// on the first return". The largest value both accept works the same on both, so a broker upgrade
/// needs no queue migration. Pinned by `tests/broker_semantics.rs`.
pub const KEEP_DELIVERY_LIMIT: u32 = i32::MAX as u32;

/// How a consuming endpoint retries: the wait tiers and the attempt cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    delays: Vec<Duration>,
    max_attempts: u32,
}

impl RetryPolicy {
    /// Tiers `delays` (attempt n+1 waits in tier n, the last repeating) and at most `max_attempts`
    /// attempts. An empty list means no retry; `max_attempts` is at least 1.
    pub fn new(delays: Vec<Duration>, max_attempts: u32) -> Self {
        Self { delays, max_attempts: max_attempts.max(1) }
    }

    /// Attempts before a message is parked.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The tier delays.
    pub fn delays(&self) -> &[Duration] {
        &self.delays
    }

    /// How long after its first delivery a message's last retry can still arrive: the sum of the
    /// waits of every retry it may get.
    pub fn horizon(&self) -> Duration {
        (0..self.max_attempts).map_while(|retry_count| self.next_delay(retry_count)).sum()
    }

    /// The wait before retrying a message that has been retried `retry_count` times already, or
    /// `None` if it has used up its attempts (attempt = `retry_count + 1` = `max_attempts`).
    pub(crate) fn next_delay(&self, retry_count: u32) -> Option<Duration> {
        if retry_count.saturating_add(1) >= self.max_attempts {
            return None;
        }
        let last = self.delays.len().checked_sub(1)?;
        Some(self.delays[(retry_count as usize).min(last)])
    }
}

/// Declare the topic exchanges named (durable). Needs the configure permission on each, even one
/// that exists: a service's own start-up uses [`ensure_exchanges`] instead.
pub async fn declare_exchanges(channel: &Channel, names: &[&str]) -> lapin::Result<()> {
    for exchange in names {
        channel
            .exchange_declare(
                (*exchange).into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() },
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// Make sure the topic exchanges named exist: each is looked up ([`missing_exchanges`], a passive
/// declare, which needs no configure permission), and only one that is missing is declared. So a
/// service whose broker user may not configure the shared exchanges (the topology's deploy step
/// declares them, decision 0030) starts once they exist, and fails with `ACCESS_REFUSED` (and
/// retries) before; a user that may, on a developer's broker, declares them itself.
pub async fn ensure_exchanges(connection: &Connection, names: &[&str]) -> lapin::Result<()> {
    let missing = missing_exchanges(connection, names).await?;
    if !missing.is_empty() {
        let channel = connection.create_channel().await?;
        declare_exchanges(&channel, &missing).await?;
        let _ = channel.close(200, "declared".into()).await;
    }
    Ok(())
}

/// Those of the exchanges named that do not exist, looked up with passive declares: RabbitMQ 3.10
/// answers anyone, 4.3 (and 4.2.6 on) a user with any permission on the name, and refuses the
/// others (`ACCESS_REFUSED`, an error here).
pub async fn missing_exchanges<'a>(connection: &Connection, names: &[&'a str]) -> lapin::Result<Vec<&'a str>> {
    missing(connection, names, |channel, name| async move {
        let passive = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
        channel.exchange_declare(name.into(), ExchangeKind::Topic, passive, FieldTable::default()).await
    })
    .await
}

/// Those of the queues named that do not exist, looked up with passive declares, as
/// [`missing_exchanges`].
pub async fn missing_queues<'a>(connection: &Connection, names: &[&'a str]) -> lapin::Result<Vec<&'a str>> {
    missing(connection, names, |channel, name| async move {
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        channel.queue_declare(name.into(), passive, FieldTable::default()).await.map(drop)
    })
    .await
}

/// Those of `names` that `look_up` finds missing (`NOT_FOUND`), on one channel, opened again after
/// each miss: the broker closes the channel that asked for something missing.
async fn missing<'a, F, Looked>(connection: &Connection, names: &[&'a str], look_up: F) -> lapin::Result<Vec<&'a str>>
where
    F: Fn(Channel, &'a str) -> Looked,
    Looked: Future<Output = lapin::Result<()>>,
{
    let mut missing = Vec::new();
    let mut channel = connection.create_channel().await?;
    for name in names {
        match look_up(channel.clone(), name).await {
            Ok(()) => {}
            Err(error) if is_not_found(&error) => {
                missing.push(*name);
                channel = connection.create_channel().await?;
            }
            Err(error) => return Err(error),
        }
    }
    let _ = channel.close(200, "looked up".into()).await;
    Ok(missing)
}

/// Declare a whole topology, the deploy step that comes before any service publishes (decision
/// 0030, `msgctl topology apply`): its exchanges, then each endpoint's exchanges, queues and
/// bindings as [`declare_endpoint`] declares them, but no wait queue (those follow each service's
/// own `RETRY_DELAYS`, and each service declares its own at start). From then on, a message
/// published reaches every endpoint bound to it, whether or not its service has ever started.
pub async fn declare_topology(connection: &Connection, topology: &Topology) -> lapin::Result<()> {
    let channel = connection.create_channel().await?;
    declare_exchanges(&channel, &topology.exchanges).await?;
    let _ = channel.close(200, "declared".into()).await;
    let no_waits = RetryPolicy::new(Vec::new(), 1);
    for endpoint in &topology.endpoints {
        declare_endpoint(connection, endpoint, &no_waits).await?;
    }
    Ok(())
}

/// Declare an endpoint's queues and bindings, on a channel of its own on `connection`: the
/// exchanges it binds to and the job events' exchange it publishes to, its own direct exchange,
/// parking, the intake of dead letters, the probe queue, the work queue, and one wait queue per
/// retry tier, each of its queues bound to the direct exchange under its own name.
///
/// A queue that already exists with other arguments (declared by a release before decision 0005)
/// makes this fail with `PRECONDITION_FAILED`; the decision record says how to move it. One
/// declared before decision 0021, which dead-letters through the default exchange, is kept as it
/// is, with a warning.
pub async fn declare_endpoint(connection: &Connection, endpoint: &Endpoint, policy: &RetryPolicy) -> lapin::Result<()> {
    let mut exchanges: Vec<&str> = endpoint.bindings.iter().map(|binding| binding.exchange).collect();
    exchanges.push(JOBS_EXCHANGE);
    ensure_exchanges(connection, &exchanges).await?;
    let mut channel = connection.create_channel().await?;
    let direct = endpoint.direct_exchange();
    channel
        .exchange_declare(
            direct.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() },
            FieldTable::default(),
        )
        .await?;
    // Neither parking nor the intake has a dead-letter target, so neither may ever reach a limit.
    let parking = endpoint.parking_queue();
    let dead_lettered = endpoint.dead_lettered_queue();
    for queue in [&parking, &dead_lettered] {
        declare_queue(&channel, queue, keeping()).await?;
        bind_by_name(&channel, &direct, queue).await?;
    }
    let probe = endpoint.probe_queue();
    let mut newest_only = quorum();
    newest_only.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
    newest_only.insert("x-overflow".into(), AMQPValue::LongString("drop-head".into()));
    declare_queue(&channel, &probe, newest_only).await?;
    bind_by_name(&channel, &direct, &probe).await?;

    // Dead letters of the work queue (delivery limit exceeded) go to the intake.
    let mut work = quorum();
    work.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(i64::from(endpoint.delivery_limit)));
    let dead_letters = DeadLetters { connection, exchange: &direct };
    dead_letters.declare(&mut channel, endpoint.name, work, &dead_lettered).await?;
    for binding in &endpoint.bindings {
        channel
            .queue_bind(
                endpoint.name.into(),
                binding.exchange.into(),
                binding.routing_key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    bind_by_name(&channel, &direct, endpoint.name).await?;

    // Wait queues have no consumer: the queue-level TTL expires each message back into the work
    // queue, through the direct exchange. Queue-level (not per-message) TTL, so one long wait
    // never holds up a short one behind it; and never through the shared exchange, which would
    // hand every other consumer of that routing key a duplicate.
    let mut delays = policy.delays().to_vec();
    delays.dedup();
    for delay in delays {
        let mut wait = quorum();
        let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        wait.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
        let queue = endpoint.wait_queue(delay);
        dead_letters.declare(&mut channel, &queue, wait, endpoint.name).await?;
        bind_by_name(&channel, &direct, &queue).await?;
    }
    let _ = channel.close(200, "declared".into()).await;
    Ok(())
}

/// Bind `queue` to the direct `exchange` under its own name.
async fn bind_by_name(channel: &Channel, exchange: &str, queue: &str) -> lapin::Result<()> {
    channel
        .queue_bind(queue.into(), exchange.into(), queue.into(), QueueBindOptions::default(), FieldTable::default())
        .await
}

/// How an endpoint's queues dead-letter: through its direct exchange, at least once.
struct DeadLetters<'a> {
    connection: &'a Connection,
    exchange: &'a str,
}

impl DeadLetters<'_> {
    /// Declare `queue` with `arguments`, dead-lettering into `target`. RabbitMQ checks, at every
    /// declaration, that the declaring user may write to the dead-letter exchange, so it is the
    /// endpoint's own (decision 0021). A queue declared by an earlier release dead-letters through
    /// the default exchange, and the broker refuses to change a queue's arguments
    /// (`PRECONDITION_FAILED`, which closes the channel): that queue is declared as it is, on a
    /// fresh channel, and its user still needs write on `amq.default` until it is moved.
    async fn declare(
        &self,
        channel: &mut Channel,
        queue: &str,
        arguments: FieldTable,
        target: &str,
    ) -> lapin::Result<()> {
        let own = dead_lettering(arguments.clone(), self.exchange, target);
        match declare_queue(channel, queue, own).await {
            Err(error) if is_precondition_failed(&error) => {
                *channel = self.connection.create_channel().await?;
                declare_queue(channel, queue, dead_lettering(arguments, "", target)).await?;
                tracing::warn!(
                    queue,
                    "declared before decision 0021: it dead-letters through the default exchange, so this service's \
                     broker user needs write on amq.default until the queue is moved"
                );
                Ok(())
            }
            declared => declared,
        }
    }
}

fn is_precondition_failed(error: &lapin::Error) -> bool {
    is_soft(error, AMQPSoftError::PRECONDITIONFAILED)
}

/// Whether the broker answered `NOT_FOUND` (a passive declare of something missing).
pub fn is_not_found(error: &lapin::Error) -> bool {
    is_soft(error, AMQPSoftError::NOTFOUND)
}

/// Whether the broker answered `ACCESS_REFUSED` (the user may not do it).
pub fn is_access_refused(error: &lapin::Error) -> bool {
    is_soft(error, AMQPSoftError::ACCESSREFUSED)
}

fn is_soft(error: &lapin::Error, soft: AMQPSoftError) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.kind() == &AMQPErrorKind::Soft(soft))
}

fn quorum() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    arguments
}

/// A quorum queue that keeps every message however often it is returned.
fn keeping() -> FieldTable {
    let mut arguments = quorum();
    arguments.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(i64::from(KEEP_DELIVERY_LIMIT)));
    arguments
}

/// `arguments` and dead-lettering, at least once, into `target` through `exchange` (direct, or
/// the default exchange). At-least-once dead-lettering needs `reject-publish` overflow: with the
/// default overflow the broker silently falls back to at-most-once.
fn dead_lettering(mut arguments: FieldTable, exchange: &str, target: &str) -> FieldTable {
    arguments.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(exchange.into()));
    arguments.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(target.into()));
    arguments.insert("x-dead-letter-strategy".into(), AMQPValue::LongString("at-least-once".into()));
    arguments.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    arguments
}

async fn declare_queue(channel: &Channel, name: &str, arguments: FieldTable) -> lapin::Result<()> {
    channel.queue_declare(ShortString::from(name), QueueDeclareOptions::durable(), arguments).await.map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_policy_caps_attempts_and_repeats_last_tier() {
        let policy = RetryPolicy::new(vec![Duration::from_secs(1), Duration::from_secs(5)], 4);
        assert_eq!(policy.next_delay(0), Some(Duration::from_secs(1)));
        assert_eq!(policy.next_delay(1), Some(Duration::from_secs(5)));
        assert_eq!(policy.next_delay(2), Some(Duration::from_secs(5)));
        assert_eq!(policy.next_delay(3), None, "attempt 4 of 4 is the last");
        assert_eq!(RetryPolicy::new(vec![Duration::from_secs(1)], 1).next_delay(0), None);
    }
}
