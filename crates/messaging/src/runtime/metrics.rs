//! The metrics every service exposes on `/metrics`, through `prometheus-client` in the OpenMetrics
//! text format. One registry per service instance ([`Metrics::default`]), not a global one, so that
//! services started in one test process keep their figures apart. Names and units follow the
//! Prometheus conventions: counters end in `_total`, durations are histograms in seconds.
//! `docs/operations.md` says what each one means and which alerts are worth setting.

use std::sync::atomic::AtomicU64;

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
        info::Info,
    },
    registry::{Metric, Registry, Unit},
};

/// Deliveries handled, by `endpoint` and `outcome` (succeeded, duplicate, retried, parked).
pub const MESSAGES_HANDLED: &str = "messages_handled_total";
/// Deliveries skipped because the inbox had already recorded their message id, by `endpoint`.
pub const INBOX_DUPLICATES: &str = "inbox_duplicates_skipped_total";
/// Batches of deliveries (`BATCH_SIZE` above 1) by endpoint and outcome: `committed` in one
/// transaction, or `fell_back` (something in it failed, and its messages were applied again one by
/// one).
pub const CONSUMER_BATCHES: &str = "consumer_batches_total";
/// Consumer sessions started, by `endpoint`: the first, and one after every lost connection.
pub const CONSUMER_SESSIONS: &str = "consumer_sessions_total";
/// Deliveries held unacked right now because their database is unreachable, by `endpoint`: an
/// outage being ridden out (they are applied once it answers, or handed back unspent).
pub const DELIVERIES_HELD: &str = "consumer_deliveries_held";
/// Outbox rows published and confirmed, by `database`.
pub const OUTBOX_PUBLISHED: &str = "outbox_published_total";
/// Outbox publishes the broker refused (returned, nacked, or closing the channel), by `database`.
pub const OUTBOX_PUBLISH_FAILURES: &str = "outbox_publish_failures_total";
/// The relay's claims (a transaction looking for due rows), whether or not they found any, by
/// `database`: with nothing due, about one a second (the poll), plus one per wake-up by `NOTIFY`.
pub const OUTBOX_CLAIMS: &str = "outbox_claims_total";

/// Labels: an endpoint.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByEndpoint {
    /// e.g. `accounts.user-registered`.
    pub endpoint: String,
}

/// Labels: an endpoint and what became of a message there.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByOutcome {
    /// The endpoint.
    pub endpoint: String,
    /// e.g. `succeeded`.
    pub outcome: String,
}

/// Labels: an outbox database.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByDatabase {
    /// Its name, e.g. `accounts`.
    pub database: String,
}

/// Labels: a broker connection, by the name it has in the management UI.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByConnection {
    /// e.g. `relay:orders`, `consumer:inventory.order-placed:publishing`.
    pub connection: String,
}

/// Labels: a readiness check, by its name in `/readyz` (e.g. `database:orders`,
/// `consumer:orders.status`, `relay:billing`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByCheck {
    /// The check.
    pub check: String,
}

/// Labels: an outbox database and a row state (`unpublished`, `parked`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByDatabaseState {
    /// The database.
    pub database: String,
    /// The rows' state.
    pub state: String,
}

/// Labels: how a job ended.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ByJobState {
    /// e.g. `succeeded`.
    pub state: String,
}

/// A family of histograms sharing one set of buckets.
pub type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// 1 ms to about 16 s, doubling: a message's transaction, a publish's lag.
fn short_durations() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 15))
}

/// 10 ms to about 5.5 min, doubling: a job's life, retries included.
fn job_durations() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 16))
}

/// Every metric of a service instance, and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// [`MESSAGES_HANDLED`].
    pub(crate) handled: Family<ByOutcome, Counter>,
    /// [`INBOX_DUPLICATES`].
    pub(crate) duplicates: Family<ByEndpoint, Counter>,
    /// [`CONSUMER_BATCHES`].
    pub(crate) batches: Family<ByOutcome, Counter>,
    /// [`CONSUMER_SESSIONS`].
    pub(crate) sessions: Family<ByEndpoint, Counter>,
    /// [`DELIVERIES_HELD`].
    pub(crate) held: Family<ByEndpoint, Gauge>,
    /// [`OUTBOX_PUBLISHED`].
    pub(crate) published: Family<ByDatabase, Counter>,
    /// [`OUTBOX_PUBLISH_FAILURES`].
    pub(crate) publish_failures: Family<ByDatabase, Counter>,
    /// [`OUTBOX_CLAIMS`].
    pub(crate) claims: Family<ByDatabase, Counter>,
    /// `message_handling_duration_seconds`: one message's transaction (inbox row, handler,
    /// commit), by endpoint and outcome (succeeded, duplicate, failed, unavailable).
    pub(crate) handling: Histograms<ByOutcome>,
    /// `outbox_publish_lag_seconds`: from an outbox row's commit to its broker confirm.
    pub(crate) publish_lag: Histograms<ByDatabase>,
    /// `job_duration_seconds`: from a job's creation (the POST) to its end, by final state.
    pub(crate) job_duration: Histograms<ByJobState>,
    /// `outbox_rows`: rows by state, read from each database at scrape time.
    pub(crate) outbox_rows: Family<ByDatabaseState, Gauge>,
    /// `outbox_oldest_unpublished_age_seconds`: how long the oldest unpublished row has waited.
    pub(crate) oldest_unpublished: Family<ByDatabase, Gauge<f64, AtomicU64>>,
    /// `outbox_topology_missing`: exchanges and queues the relay holds rows for.
    pub(crate) topology_missing: Family<ByDatabase, Gauge>,
    /// `broker_connection_blocked_seconds`: how long the broker has blocked each connection.
    pub(crate) connection_blocked: Family<ByConnection, Gauge<f64, AtomicU64>>,
    /// `readiness_failing_seconds`: how long each readiness check has failed (0 while it passes).
    pub(crate) readiness_failing: Family<ByCheck, Gauge<f64, AtomicU64>>,
    /// `http_request_timeouts_total`: requests the server answered 503 itself, past
    /// `HTTP_REQUEST_TIMEOUT` ([`crate::runtime::serve`]).
    pub(crate) request_timeouts: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut metrics = Self {
            registry: Registry::default(),
            handled: Family::default(),
            duplicates: Family::default(),
            batches: Family::default(),
            sessions: Family::default(),
            held: Family::default(),
            handling: Family::new_with_constructor(short_durations),
            published: Family::default(),
            publish_failures: Family::default(),
            claims: Family::default(),
            publish_lag: Family::new_with_constructor(short_durations),
            job_duration: Family::new_with_constructor(job_durations),
            outbox_rows: Family::default(),
            oldest_unpublished: Family::default(),
            topology_missing: Family::default(),
            connection_blocked: Family::default(),
            readiness_failing: Family::default(),
            request_timeouts: Counter::default(),
        };
        metrics.register_consumers();
        metrics.register_outboxes();
        // `build_info{failpoints="on"}` only in a test build (decision 0025): what an operator
        // checks a production build by, and what the test kit checks its binaries by.
        let failpoints = if crate::runtime::failpoint::COMPILED_IN { "on" } else { "off" };
        metrics.registry.register(
            "http_request_timeouts",
            "Requests to the service's own routes (not /healthz, /readyz, /metrics) the server answered 503 \
             itself, past HTTP_REQUEST_TIMEOUT: whatever they waited for (a permit, a route) did not answer in time",
            metrics.request_timeouts.clone(),
        );
        metrics.registry.register(
            "build",
            "What this build carries: the fault suite's failpoints are on only in a test build",
            Info::new(vec![("failpoints".to_owned(), failpoints.to_owned())]),
        );
        metrics
    }
}

impl Metrics {
    /// The consumers' series, and the jobs' durations.
    fn register_consumers(&mut self) {
        let r = &mut self.registry;
        r.register("messages_handled", "Deliveries handled, by endpoint and outcome", self.handled.clone());
        r.register(
            "inbox_duplicates_skipped",
            "Redelivered messages skipped because the inbox had already processed them",
            self.duplicates.clone(),
        );
        r.register(
            "consumer_batches",
            "Batches of deliveries applied in one transaction (committed), or applied again one by one (fell_back)",
            self.batches.clone(),
        );
        r.register(
            "consumer_sessions",
            "Consumer sessions started: the first, and one after every lost broker connection",
            self.sessions.clone(),
        );
        r.register(
            "consumer_deliveries_held",
            "Deliveries held unacked while their database is unreachable",
            self.held.clone(),
        );
        r.register_with_unit(
            "message_handling_duration",
            "One message's transaction (inbox row, handler, commit), by endpoint and outcome",
            Unit::Seconds,
            self.handling.clone(),
        );
        r.register_with_unit(
            "job_duration",
            "From a job's creation (POST /orders) to its end, by final state",
            Unit::Seconds,
            self.job_duration.clone(),
        );
    }

    /// The relay's series, and the outbox gauges every service reads at scrape time.
    fn register_outboxes(&mut self) {
        let r = &mut self.registry;
        r.register("outbox_published", "Outbox rows published with a broker confirm", self.published.clone());
        r.register(
            "outbox_publish_failures",
            "Outbox publishes the broker refused (returned as unroutable, nacked, or closing the channel); the rows \
             are retried, and one that closes the channel is parked after RELAY_MAX_ATTEMPTS",
            self.publish_failures.clone(),
        );
        r.register(
            "outbox_claims",
            "The relay's claims of due outbox rows, whether or not they found any",
            self.claims.clone(),
        );
        r.register_with_unit(
            "outbox_publish_lag",
            "From an outbox row's commit to its broker confirm",
            Unit::Seconds,
            self.publish_lag.clone(),
        );
        r.register(
            "outbox_rows",
            "Unpublished outbox rows: waiting to be published, or parked (refused by the broker, until an operator \
             re-arms them); counted up to 100,000",
            self.outbox_rows.clone(),
        );
        r.register_with_unit(
            "broker_connection_blocked",
            "How long the broker has blocked this connection (a memory or disk alarm; 0 when it does not): lapin \
             writes nothing on it meanwhile",
            Unit::Seconds,
            self.connection_blocked.clone(),
        );
        r.register_with_unit(
            "readiness_failing",
            "How long this readiness check has failed (0 while it passes), whether or not it takes the service out \
             of /readyz (the API reports its broker links without failing on them)",
            Unit::Seconds,
            self.readiness_failing.clone(),
        );
        r.register_with_unit(
            "outbox_oldest_unpublished_age",
            "How long the oldest outbox row waiting to be published has waited, parked rows aside (0 when none waits)",
            Unit::Seconds,
            self.oldest_unpublished.clone(),
        );
        r.register(
            "outbox_topology_missing",
            "Exchanges and queues of the expected topology that the relay last found missing: it holds the rows \
             whose messages would not reach them (decision 0030); 0 once all exist",
            self.topology_missing.clone(),
        );
    }
}

/// What a delivery came to at an endpoint, in `messages_handled_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// Applied and acked.
    Succeeded,
    /// Skipped by the inbox.
    Duplicate,
    /// Sent to a wait queue.
    Retried,
    /// Sent to parking.
    Parked,
    /// Sent back to wait for an earlier message of its ordering key, no attempt spent.
    Deferred,
}

impl Handled {
    /// Every outcome, in the order of its discriminant.
    const ALL: [Self; 5] = [Self::Succeeded, Self::Duplicate, Self::Retried, Self::Parked, Self::Deferred];

    /// Its `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Duplicate => "duplicate",
            Self::Retried => "retried",
            Self::Parked => "parked",
            Self::Deferred => "deferred",
        }
    }
}

/// How one message's transaction ended, in `message_handling_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handling {
    /// Committed.
    Succeeded,
    /// The inbox already had it.
    Duplicate,
    /// The handler failed (transient, permanent or timed out).
    Failed,
    /// The database could not be reached.
    Unavailable,
    /// Rolled back: an earlier message of its ordering key is not applied yet.
    Deferred,
}

impl Handling {
    /// Every outcome, in the order of its discriminant.
    const ALL: [Self; 5] = [Self::Succeeded, Self::Duplicate, Self::Failed, Self::Unavailable, Self::Deferred];

    /// Its `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Duplicate => "duplicate",
            Self::Failed => "failed",
            Self::Unavailable => "unavailable",
            Self::Deferred => "deferred",
        }
    }
}

/// One endpoint's series, looked up once when its consumer starts, so that handling a message
/// allocates no label set and takes no lock on a family. Every outcome's series exists from the
/// start, at 0.
#[derive(Debug, Clone)]
pub struct EndpointMetrics {
    handled: [Counter; 5],
    handling: [Histogram; 5],
    duplicates: Counter,
    /// Committed, fell back.
    batches: [Counter; 2],
    sessions: Counter,
    held: Gauge,
}

impl EndpointMetrics {
    /// Count a delivery's outcome.
    pub fn handled(&self, outcome: Handled) {
        self.handled[outcome as usize].inc();
    }

    /// Record how long a message's transaction took, by how it ended.
    pub fn handling(&self, outcome: Handling, seconds: f64) {
        self.handling[outcome as usize].observe(seconds);
    }

    /// Count a copy the inbox skipped.
    pub fn duplicate(&self) {
        self.duplicates.inc();
    }

    /// Count a batch: `committed` in one transaction, or not (applied again one by one).
    pub fn batch(&self, committed: bool) {
        self.batches[usize::from(!committed)].inc();
    }

    /// Count a consumer session that started consuming.
    pub(crate) fn session_started(&self) {
        self.sessions.inc();
    }

    /// A delivery is held for its database: counted in [`DELIVERIES_HELD`] until the guard drops.
    pub fn held(&self) -> Held {
        self.held.inc();
        Held(self.held.clone())
    }
}

/// A delivery counted as held for its database, until dropped (whichever way its wait ends).
#[derive(Debug)]
#[must_use = "the delivery counts as held only while this lives"]
pub struct Held(Gauge);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One outbox's series (the relay's, for one database), looked up once.
#[derive(Debug, Clone)]
pub struct OutboxMetrics {
    published: Counter,
    publish_failures: Counter,
    claims: Counter,
    publish_lag: Histogram,
    topology_missing: Gauge,
}

impl OutboxMetrics {
    /// How many exchanges and queues the relay last found missing, and holds rows for.
    pub fn topology_missing(&self, count: usize) {
        self.topology_missing.set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// Count rows published with a confirm (and marked).
    pub fn published(&self, rows: u64) {
        self.published.inc_by(rows);
    }

    /// Count a publish the broker refused (the row is retried, or parked).
    pub fn publish_failed(&self) {
        self.publish_failures.inc();
    }

    /// Count a claim of due rows, whether or not it found any.
    pub fn claimed(&self) {
        self.claims.inc();
    }

    /// Record how long a row waited from its commit to its confirm.
    pub fn publish_lag(&self, seconds: f64) {
        self.publish_lag.observe(seconds);
    }
}

impl Metrics {
    /// The series of the outbox in `database`.
    pub fn outbox(&self, database: &str) -> OutboxMetrics {
        let by = ByDatabase { database: database.to_owned() };
        OutboxMetrics {
            published: self.published.get_or_create(&by).clone(),
            publish_failures: self.publish_failures.get_or_create(&by).clone(),
            claims: self.claims.get_or_create(&by).clone(),
            publish_lag: self.publish_lag.get_or_create(&by).clone(),
            topology_missing: self.topology_missing.get_or_create(&by).clone(),
        }
    }

    /// Record a job that ended in `state` after `seconds` (`job_duration_seconds`).
    pub fn job_ended(&self, state: &str, seconds: f64) {
        self.job_duration.get_or_create(&ByJobState { state: state.to_owned() }).observe(seconds);
    }

    /// The series of `endpoint`.
    pub fn endpoint(&self, endpoint: &str) -> EndpointMetrics {
        let by = |outcome: &str| ByOutcome { endpoint: endpoint.to_owned(), outcome: outcome.to_owned() };
        let alone = ByEndpoint { endpoint: endpoint.to_owned() };
        EndpointMetrics {
            handled: Handled::ALL.map(|outcome| self.handled.get_or_create(&by(outcome.as_str())).clone()),
            handling: Handling::ALL.map(|outcome| self.handling.get_or_create(&by(outcome.as_str())).clone()),
            duplicates: self.duplicates.get_or_create(&alone).clone(),
            batches: ["committed", "fell_back"].map(|outcome| self.batches.get_or_create(&by(outcome)).clone()),
            sessions: self.sessions.get_or_create(&alone).clone(),
            held: self.held.get_or_create(&alone).clone(),
        }
    }

    /// Register a service's own metric (`name` without `_total`; see `prometheus-client`'s
    /// `Registry::register`) beside the runtime's, before the metrics are shared. The service keeps
    /// its handle to the metric and counts through it.
    ///
    /// ```
    /// use messaging::runtime::metrics::Metrics;
    /// use prometheus_client::metrics::counter::Counter;
    ///
    /// let mut metrics = Metrics::default();
    /// let refunds = Counter::<u64>::default();
    /// metrics.register("refunds", "Refunds issued", refunds.clone());
    /// refunds.inc();
    /// assert!(metrics.render().contains("refunds_total 1"));
    /// ```
    pub fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.registry.register(name, help, metric);
    }

    /// Every metric in the OpenMetrics text format (served as `CONTENT_TYPE`).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The content type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_openmetrics_text_with_conventional_names() {
        let metrics = Metrics::default();
        let endpoint = metrics.endpoint("a");
        endpoint.handled(Handled::Succeeded);
        endpoint.handled(Handled::Succeeded);
        endpoint.duplicate();
        endpoint.handling(Handling::Succeeded, 0.003);
        let out = metrics.render();
        assert!(out.contains("messages_handled_total{endpoint=\"a\",outcome=\"succeeded\"} 2\n"), "{out}");
        assert!(out.contains("messages_handled_total{endpoint=\"a\",outcome=\"parked\"} 0\n"), "{out}");
        assert!(out.contains("inbox_duplicates_skipped_total{endpoint=\"a\"} 1\n"), "{out}");
        assert!(out.contains("# HELP messages_handled Deliveries handled, by endpoint and outcome.\n"), "{out}");
        assert!(out.contains("# TYPE message_handling_duration_seconds histogram"), "{out}");
        assert!(
            out.contains(
                "message_handling_duration_seconds_bucket{le=\"0.004\",endpoint=\"a\",outcome=\"succeeded\"} 1"
            ),
            "{out}"
        );
        assert!(out.ends_with("# EOF\n"), "{out}");
    }
}
