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
use messaging_core::contracts::{Contract, JOBS_EXCHANGE};

use crate::runtime::duration::format_duration;

/// Returns of one message to the work queue before the broker itself dead-letters it. Every
/// return the runtime causes counts, handled or not: a crash, a reconnect, a shutdown, each a
/// channel closing with the delivery unacked, on 3.10, 4.0 and 4.3 alike (4.3 stopped counting
/// only `basic.nack`, which the runtime never sends: decision 0011). So a message prefetched
/// beside a crashing one is returned with it: the runtime
/// bounds crash loops itself, after at most `max_crashes + 1` crashes (decision 0005). This is the
/// last resort far above that bound, high enough for a long database outage with a flapping
/// broker connection; what it dead-letters is still parked with a reason and its job quarantined.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 1000;

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

/// A binding of an endpoint's work queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The exchange.
    pub exchange: &'static str,
    /// Its routing key pattern.
    pub routing_key: &'static str,
}

/// A consuming endpoint: one work queue (named after the endpoint), its bindings, and the message
/// types and major versions it accepts (anything else is parked on arrival).
///
/// ```
/// use messaging::{contracts::Contract, envelope::Unreadable, topology::Endpoint};
/// # #[derive(serde::Serialize)] struct ParcelShipped;
/// # impl Contract for ParcelShipped { const TYPE: &'static str = "parcel.shipped"; const EXCHANGE: &'static str = "shipping"; }
///
/// let endpoint = Endpoint::new("billing.parcel-shipped").consume::<ParcelShipped>();
/// assert_eq!(endpoint.parking_queue(), "billing.parcel-shipped.parking");
/// assert_eq!(endpoint.check("parcel.shipped", 1), Ok(()));
/// // A major version it does not know yet, or a type it never asked for, is parked on arrival.
/// assert!(matches!(endpoint.check("parcel.shipped", 2), Err(Unreadable::UnsupportedVersion { .. })));
/// assert!(matches!(endpoint.check("parcel.lost", 1), Err(Unreadable::UnknownType(_))));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// e.g. `accounts.user-registered`: the work queue's name and the prefix of its other queues.
    pub name: &'static str,
    /// Where its messages come from.
    pub bindings: Vec<Binding>,
    /// (type, highest major version understood).
    pub accepts: Vec<(&'static str, u32)>,
    /// The broker's delivery limit on the work queue (crash safety net).
    pub delivery_limit: u32,
    /// Apply the messages of one ordering key in their outbox order ([`Endpoint::ordered_by_key`]).
    pub ordered_by_key: bool,
}

impl Endpoint {
    /// An endpoint with no bindings yet.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            bindings: Vec::new(),
            accepts: Vec::new(),
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
            ordered_by_key: false,
        }
    }

    /// Apply the messages that carry one ordering key ([`messaging_core::envelope::Headers::ordered_by`])
    /// in the order their outbox rows committed, whatever order they arrive in, across retries
    /// and consumer instances: a message that arrives before an earlier one of its key is applied
    /// goes back to wait (its first wait tier, spending no attempt) and is tried again. Messages
    /// of other keys, and messages without a key, flow as before. A message waits only for the
    /// earlier messages of its key of the types this endpoint takes ([`Endpoint::takes`]). A
    /// parked message gives up its place, even one parked before its turn: its key's later
    /// messages go on, and a redrive applies it late (decisions 0017, 0024).
    pub fn ordered_by_key(self) -> Self {
        Self { ordered_by_key: true, ..self }
    }

    /// Bind the work queue to `routing_key` on `exchange`.
    pub fn bind(mut self, exchange: &'static str, routing_key: &'static str) -> Self {
        self.bindings.push(Binding { exchange, routing_key });
        self
    }

    /// Consume contract `C`: bind its routing key on its exchange, and accept it up to its
    /// current major version.
    pub fn consume<C: Contract>(self) -> Self {
        self.bind(C::EXCHANGE, C::TYPE).accept::<C>()
    }

    /// Accept messages of contract `C` up to its current major version.
    pub fn accept<C: Contract>(mut self) -> Self {
        self.accepts.push((C::TYPE, C::VERSION));
        self
    }

    /// Whether this endpoint takes messages of `message_type` (at some version).
    pub fn takes(&self, message_type: &str) -> bool {
        self.accepts.iter().any(|(accepted, _)| *accepted == message_type)
    }

    /// Whether a message of this type and version can be handled here.
    pub fn check(&self, message_type: &str, version: u32) -> Result<(), messaging_core::envelope::Unreadable> {
        use messaging_core::envelope::Unreadable;
        match self.accepts.iter().find(|(t, _)| *t == message_type) {
            None => Err(Unreadable::UnknownType(message_type.to_owned())),
            Some((_, max)) if version > *max || version == 0 => {
                Err(Unreadable::UnsupportedVersion { message_type: message_type.to_owned(), version })
            }
            Some(_) => Ok(()),
        }
    }

    /// `<endpoint>.parking`.
    pub fn parking_queue(&self) -> String {
        format!("{}.parking", self.name)
    }

    /// `<endpoint>.dead-lettered`: where the broker dead-letters the work queue's messages (its
    /// delivery limit). The runtime moves each one on to parking with a reason and a job event, so
    /// a broker-side dead letter still ends its job (decision 0005).
    pub fn dead_lettered_queue(&self) -> String {
        format!("{}.dead-lettered", self.name)
    }

    /// `<endpoint>.direct`: the endpoint's own direct exchange. Retry and parking copies, deferrals
    /// and redrives go through it, with the target queue's name as the routing key, so no copy
    /// goes through the shared exchange (which would hand every other consumer of that routing key
    /// a duplicate), nor through the default exchange, which a broker user cannot be limited to
    /// its own queues on (RabbitMQ checks only `amq.default`).
    pub fn direct_exchange(&self) -> String {
        direct_exchange_of(self.name)
    }

    /// `<endpoint>.probe`: a quorum queue that keeps only its newest message, where each consumer
    /// session publishes every few seconds to learn that the broker can still take a write for
    /// this endpoint (a majority of the queue's members), which nothing else would tell it.
    pub fn probe_queue(&self) -> String {
        format!("{}.probe", self.name)
    }

    /// `<endpoint>.wait.<delay>`, e.g. `accounts.user-registered.wait.5s`. The delay is part of the
    /// name, so a changed tier list declares new queues instead of clashing with old arguments.
    pub fn wait_queue(&self, delay: Duration) -> String {
        format!("{}.wait.{}", self.name, format_duration(delay))
    }
}

/// The direct exchange of the endpoint named `endpoint` ([`Endpoint::direct_exchange`]), for a
/// tool that knows only the name (`msgctl`, from a parking queue's).
pub fn direct_exchange_of(endpoint: &str) -> String {
    format!("{endpoint}.direct")
}

/// Declare the topic exchanges named (durable). Everybody who publishes to one or binds to one
/// declares it, so start-up order between services does not matter.
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
    let mut channel = connection.create_channel().await?;
    let mut exchanges: Vec<&str> = endpoint.bindings.iter().map(|binding| binding.exchange).collect();
    exchanges.push(JOBS_EXCHANGE);
    declare_exchanges(&channel, &exchanges).await?;
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
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp)
        if amqp.kind() == &AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED))
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

    #[test]
    fn endpoint_names_its_queues_and_checks_versions() {
        let endpoint = Endpoint::new("status").consume::<messaging_core::contracts::JobQuarantined>();
        assert_eq!(endpoint.bindings, [Binding { exchange: "jobs", routing_key: "job.quarantined" }]);
        assert_eq!(endpoint.parking_queue(), "status.parking");
        assert_eq!(endpoint.dead_lettered_queue(), "status.dead-lettered");
        assert_eq!(endpoint.wait_queue(Duration::from_secs(5)), "status.wait.5s");
        assert_eq!(endpoint.direct_exchange(), "status.direct");
        assert_eq!(endpoint.probe_queue(), "status.probe");
        assert!(endpoint.check("job.quarantined", 1).is_ok());
        assert!(endpoint.check("job.quarantined", 2).is_err());
        assert!(endpoint.check("job.cancelled", 1).is_err());
    }
}
