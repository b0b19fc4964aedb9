//! Who consumes what: a consuming endpoint ([`Endpoint`]), the queues named after it, and a whole
//! system's endpoints and exchanges ([`Topology`]), which a deploy step declares before any service
//! publishes and the relay checks every message against (decision 0030). Data only: declaring it
//! on a broker is `messaging::topology`'s.

use std::time::Duration;

use crate::contracts::Contract;

/// Returns of one message to the work queue before the broker itself dead-letters it. Every
/// return the runtime causes counts, handled or not: a crash, a reconnect, a shutdown, each a
/// channel closing with the delivery unacked, on 3.10, 4.0 and 4.3 alike (4.3 stopped counting
/// only `basic.nack`, which the runtime never sends: decision 0011). So a message prefetched
/// beside a crashing one is returned with it: the runtime
/// bounds crash loops itself, after at most `max_crashes + 1` crashes (decision 0005). This is the
/// last resort far above that bound, high enough for a long database outage with a flapping
/// broker connection; what it dead-letters is still parked with a reason and its job quarantined.
pub const DEFAULT_DELIVERY_LIMIT: u32 = 1000;

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
/// use messaging_core::{contracts::Contract, endpoint::Endpoint, envelope::Unreadable};
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

    /// Apply the messages that carry one ordering key ([`crate::envelope::Headers::ordered_by`])
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

    /// Whether a message published to `exchange` with `routing_key` reaches its work queue: a
    /// binding of it matches ([`topic_matches`]).
    pub fn receives(&self, exchange: &str, routing_key: &str) -> bool {
        self.bindings
            .iter()
            .any(|binding| binding.exchange == exchange && topic_matches(binding.routing_key, routing_key))
    }

    /// Bind contract `C`'s routing key on its exchange, without accepting it here: for an endpoint
    /// whose handler's routes say what it accepts ([`Routes`](crate::handler::Routes), which the
    /// consumer adds to the endpoint's own), so that its contracts are listed once. Not for a
    /// contract routed by body ([`Contract::ROUTED_BY_BODY`]).
    pub fn bind_contract<C: Contract>(self) -> Self {
        const { assert!(!C::ROUTED_BY_BODY, "a contract routed by body is bound by its keys") };
        self.bind(C::EXCHANGE, C::TYPE)
    }

    /// Consume contract `C`: bind its routing key on its exchange, and accept it up to its
    /// current major version. Not for a contract routed by body ([`Contract::ROUTED_BY_BODY`]):
    /// [`Endpoint::consume_keys`] names its keys, and this does not compile.
    ///
    /// ```compile_fail
    /// # use messaging_core::{contracts::Contract, endpoint::Endpoint};
    /// # #[derive(serde::Serialize)] struct Ended;
    /// # impl Contract for Ended {
    /// #     const TYPE: &'static str = "ended";
    /// #     const EXCHANGE: &'static str = "shop";
    /// #     const ROUTED_BY_BODY: bool = true;
    /// # }
    /// let endpoint = Endpoint::new("audit").consume::<Ended>();
    /// ```
    pub fn consume<C: Contract>(self) -> Self {
        const { assert!(!C::ROUTED_BY_BODY, "a contract routed by body is consumed with consume_keys") };
        self.bind(C::EXCHANGE, C::TYPE).accept::<C>()
    }

    /// Consume contract `C` under each of `routing_keys` (patterns: `*` a word, `#` any words), for
    /// a contract routed by what its messages say ([`Contract::routing_key`]): bind each on its
    /// exchange, and accept it up to its current major version.
    pub fn consume_keys<C: Contract>(self, routing_keys: &[&'static str]) -> Self {
        routing_keys.iter().fold(self, |endpoint, key| endpoint.bind(C::EXCHANGE, key)).accept::<C>()
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
    pub fn check(&self, message_type: &str, version: u32) -> Result<(), crate::envelope::Unreadable> {
        use crate::envelope::Unreadable;
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

/// Format a duration the way queue names and `RETRY_DELAYS` spell it: the largest whole unit.
pub fn format_duration(duration: Duration) -> String {
    let ms = duration.as_millis();
    match ms {
        _ if ms.is_multiple_of(3_600_000) => format!("{}h", ms / 3_600_000),
        _ if ms.is_multiple_of(60_000) => format!("{}m", ms / 60_000),
        _ if ms.is_multiple_of(1_000) => format!("{}s", ms / 1_000),
        _ => format!("{ms}ms"),
    }
}

/// A system's topology: the topic exchanges its services publish to, and every consuming endpoint
/// with its bindings. From it, the queues a message must reach ([`Topology::queues_for`]).
///
/// ```
/// use messaging_core::endpoint::{Endpoint, Topology};
///
/// let topology = Topology::new(["orders"])
///     .endpoint(Endpoint::new("billing").bind("orders", "order.*"))
///     .endpoint(Endpoint::new("audit").bind("orders", "#"))
///     .endpoint(Endpoint::new("stock").bind("orders", "order.placed"));
/// assert_eq!(topology.queues_for("orders", "order.ended"), ["billing", "audit"]);
/// assert_eq!(topology.queues_for("orders", "order.placed"), ["billing", "audit", "stock"]);
/// assert!(topology.queues_for("elsewhere", "order.placed").is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    /// The topic exchanges, durable.
    pub exchanges: Vec<&'static str>,
    /// Every consuming endpoint.
    pub endpoints: Vec<Endpoint>,
}

impl Topology {
    /// A topology of these topic exchanges and no endpoint yet.
    pub fn new(exchanges: impl IntoIterator<Item = &'static str>) -> Self {
        Self { exchanges: exchanges.into_iter().collect(), endpoints: Vec::new() }
    }

    /// With `endpoint` too.
    pub fn endpoint(mut self, endpoint: Endpoint) -> Self {
        self.endpoints.push(endpoint);
        self
    }

    /// The work queues that a message published to `exchange` with `routing_key` reaches when
    /// the whole topology is declared: one per endpoint with a binding that matches it, in the
    /// endpoints' order.
    pub fn queues_for(&self, exchange: &str, routing_key: &str) -> Vec<&'static str> {
        self.endpoints.iter().filter(|endpoint| endpoint.receives(exchange, routing_key)).map(|e| e.name).collect()
    }
}

/// Whether a topic exchange routes `routing_key` through a binding of `pattern`: words between
/// dots, `*` standing for exactly one word and `#` for any number, none included.
pub fn topic_matches(pattern: &str, routing_key: &str) -> bool {
    fn words(pattern: &[&str], key: &[&str]) -> bool {
        match pattern.split_first() {
            None => key.is_empty(),
            Some((&"#", rest)) => (0..=key.len()).any(|skip| words(rest, &key[skip..])),
            Some((&word, rest)) => {
                key.split_first().is_some_and(|(first, tail)| (word == "*" || word == *first) && words(rest, tail))
            }
        }
    }
    let pattern: Vec<&str> = pattern.split('.').collect();
    let key: Vec<&str> = if routing_key.is_empty() { Vec::new() } else { routing_key.split('.').collect() };
    words(&pattern, &key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns_match_as_the_broker_routes() {
        assert!(topic_matches("order.placed", "order.placed"));
        assert!(!topic_matches("order.placed", "order.ended"));
        assert!(topic_matches("order.*", "order.ended"));
        assert!(!topic_matches("order.*", "order.ended.late"));
        assert!(topic_matches("job.#", "job.quarantined"));
        assert!(topic_matches("job.#", "job"));
        assert!(topic_matches("#", "anything.at.all"));
        assert!(topic_matches("#.ended", "order.ended"));
        assert!(!topic_matches("job.#", "jobs.quarantined"));
        assert!(!topic_matches("*", ""));
    }

    #[test]
    fn endpoint_names_its_queues_and_checks_versions() {
        let endpoint = Endpoint::new("status").consume::<crate::contracts::JobQuarantined>();
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
