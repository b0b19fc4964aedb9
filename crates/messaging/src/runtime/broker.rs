//! Broker connections. lapin does not recover lost connections reliably by itself, so every
//! long-running loop in this workspace owns a "session": connect, declare, work until the
//! connection fails, then reconnect here with backoff. Nothing is acked or marked published on a
//! connection that failed, so what was in flight is redelivered or republished by the next session.
//!
//! A cluster is named by several URLs ([`BrokerNodes`]): each reconnect starts at the node after
//! the one whose connection was lost, and tries every node in turn before it waits.

use std::{sync::Arc, time::Duration};

use lapin::{Connection, ConnectionProperties, DefaultConnectionBuilder};

use crate::runtime::{
    backoff::Backoff,
    config::{BrokerNodes, SecretUrl},
    health::Readiness,
    shutdown::Shutdown,
    tls::TlsFiles,
};

/// A long-running broker client: where it connects, its name (shown in the broker's management
/// UI, and the readiness flag that says whether it is up, and on which node), and how long it
/// waits between rounds of tries.
#[derive(Debug, Clone)]
pub struct Link {
    /// The broker's nodes.
    pub nodes: BrokerNodes,
    /// e.g. `consumer:accounts.user-registered`, `relay:accounts`.
    pub name: String,
    /// Between connection attempts.
    pub backoff: Backoff,
    /// Where its readiness flag (`name`) lives.
    pub readiness: Arc<Readiness>,
}

/// The heartbeat asked for unless the URL names one (`?heartbeat=N`, seconds): lapin gives up on a
/// connection that has heard nothing for twice that, so a node cut off by a partition, whose
/// connections stay open and silent, is left after 20 s rather than after the broker's default
/// of 60 s twice over.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// How long one connection attempt may take: a node cut off by a partition accepts nothing and
/// refuses nothing, and the next node should be tried instead.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Open one connection, named `name` in the broker's management UI, with [`HEARTBEAT`], or fail
/// with `TimedOut` after [`CONNECT_TIMEOUT`]. An `amqps://` URL may name its CA file and client
/// certificate in its query ([`crate::runtime::tls`]); they are read at every connect, so a
/// rotated certificate is picked up by the next reconnect.
pub async fn connect(url: &SecretUrl, name: &str) -> lapin::Result<Connection> {
    tokio::time::timeout(CONNECT_TIMEOUT, connect_unbounded(url, name)).await.unwrap_or_else(|_| {
        let silent = format!("no answer within {}", crate::runtime::duration::format_duration(CONNECT_TIMEOUT));
        Err(lapin::Error::from(std::io::Error::new(std::io::ErrorKind::TimedOut, silent)))
    })
}

async fn connect_unbounded(url: &SecretUrl, name: &str) -> lapin::Result<Connection> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let parsed = url::Url::parse(url.expose())
        .map_err(|error| lapin::Error::from(std::io::Error::new(std::io::ErrorKind::InvalidInput, error)))?;
    let files = TlsFiles::of_url(&parsed);
    let tls = files.amqp().map_err(lapin::Error::from)?;
    let mut uri = TlsFiles::strip(&parsed);
    if !uri.query_pairs().any(|(key, _)| key == "heartbeat") {
        uri.query_pairs_mut().append_pair("heartbeat", &HEARTBEAT.as_secs().to_string());
    }
    DefaultConnectionBuilder::new()?
        .with_uri_str(uri.into())
        .with_properties(properties)
        .with_tls_config(tls)
        .connect()
        .await
}

/// At start-up, before anything is written: one connection to each of the broker's nodes. A
/// certificate that does not verify, or TLS files that cannot be read, is an error naming the node
/// and the reason, which no retry would cure. Anything else (a node not up yet) is left to the
/// sessions' reconnect loops.
pub async fn check_tls(nodes: &BrokerNodes) -> Result<(), crate::runtime::startup::StartupError> {
    for index in 0..nodes.len() {
        let url = nodes.url(index);
        match connect(url, "start-up check").await {
            Ok(connection) => {
                let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "checked".into())).await;
            }
            Err(error) => {
                if let Some(reason) = messaging_core::outage::verification_failure(&error) {
                    let refusal = format!("the broker at {url}: TLS: {reason}");
                    return Err(crate::runtime::startup::StartupError(refusal));
                }
            }
        }
    }
    Ok(())
}

/// One connection, to the first of the nodes that answers within [`CONNECT_TIMEOUT`], trying each
/// once from `first`. The error is the last node's.
pub async fn connect_any(nodes: &BrokerNodes, first: usize, name: &str) -> lapin::Result<(Connection, usize)> {
    let mut last = None;
    for index in (first..).take(nodes.len()) {
        match connect(nodes.url(index), name).await {
            Ok(connection) => return Ok((connection, index % nodes.len())),
            Err(error) => {
                if nodes.len() > 1 {
                    tracing::warn!(%error, url = %nodes.url(index), "cannot reach this broker node; trying the next");
                }
                last = Some(error);
            }
        }
    }
    Err(last.expect("a node list names at least one node"))
}

/// Connect, trying the nodes in turn from `first` and waiting with backoff after each round in
/// which none answered, until one does (its connection and index) or shutdown is asked for
/// (`None`). With one node, every failed try is a round.
pub(crate) async fn connect_with_backoff(
    nodes: &BrokerNodes,
    first: usize,
    name: &str,
    backoff: Backoff,
    shutdown: &Shutdown,
) -> Option<(Connection, usize)> {
    let mut rounds = 0;
    loop {
        if shutdown.is_triggered() {
            return None;
        }
        match connect_any(nodes, first, name).await {
            Ok(connected) => return Some(connected),
            Err(error) => {
                let delay = backoff.delay(rounds);
                tracing::warn!(%error, %nodes, ?delay, "cannot reach the broker; retrying");
                rounds += 1;
                if !shutdown.sleep(delay).await {
                    return None;
                }
            }
        }
    }
}

/// How one session (a connection's worth of work) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEnd {
    /// Shutdown was asked for and the session finished its work: stop.
    Shutdown,
    /// The connection failed or became unusable. `was_up` says whether the session got as far as
    /// working; if so, the next reconnect starts again from the shortest backoff.
    Lost {
        /// The session had declared its topology and started working.
        was_up: bool,
    },
}

/// One connection's worth of work: consume, or publish, until shutdown or the connection fails.
pub trait Session {
    /// Work on `connection`, to the link's node of index `node`; set the link's readiness flag
    /// once up.
    fn run(&mut self, connection: &Connection, node: usize) -> impl std::future::Future<Output = SessionEnd> + Send;
}

/// Keep `name`'s entry of [`Readiness::blocked`] as the broker says: RabbitMQ sends
/// `connection.blocked` when a resource alarm (memory, disk) stops it reading from a connection
/// that publishes, and `connection.unblocked` when the alarms clear. lapin then writes nothing on
/// the connection, acks included, until unblocked. Runs until aborted (at the session's end).
pub(crate) fn watch_blocked(
    connection: &Connection,
    name: String,
    readiness: &Arc<Readiness>,
) -> tokio::task::JoinHandle<()> {
    use futures_util::StreamExt;
    let mut events = connection.events_listener();
    let readiness = Arc::clone(readiness);
    // Listening first, then reading the state: a block that comes in between is still heard.
    let already = connection.status().blocked().then(|| "blocked before it was watched".to_owned());
    readiness.set_blocked(&name, already);
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            match event {
                lapin::Event::ConnectionBlocked(reason) => readiness.set_blocked(&name, Some(reason)),
                lapin::Event::ConnectionUnblocked => readiness.set_blocked(&name, None),
                _ => {}
            }
        }
    })
}

/// Wait until the broker unblocks `connection`, or it is lost, or shutdown is asked for. Not
/// bounded by a deadline of its own: an alarm lasts as long as the broker is short of memory or
/// disk, and it is seen for as long (readiness, `broker_connection_blocked_seconds`, an alert).
async fn wait_unblocked(connection: &Connection, shutdown: &Shutdown) {
    while connection.status().blocked() && connection.status().connected() {
        if !shutdown.sleep(Duration::from_millis(200)).await {
            return;
        }
    }
}

/// The reconnect loop every long-running broker client uses: connect (with the link's backoff),
/// run `session` on the connection, close it, and start again after a backoff until a session
/// ends with [`SessionEnd::Shutdown`] or shutdown is asked for. A lost connection's successor is
/// tried on the next node first. The link's readiness flag is cleared after every session (the
/// session sets it once it is up), and its node is the one it is connected to.
pub async fn run_sessions(link: &Link, shutdown: &Shutdown, session: &mut impl Session) {
    let (readiness, flag, backoff) = (&link.readiness, link.name.as_str(), link.backoff);
    readiness.set(flag, false);
    let (mut failures, mut first) = (0, 0);
    while let Some((connection, node)) = connect_with_backoff(&link.nodes, first, flag, backoff, shutdown).await {
        readiness.set_node(flag, Some(link.nodes.address(node)));
        let watching = watch_blocked(&connection, flag.to_owned(), readiness);
        let end = session.run(&connection, node).await;
        readiness.set(flag, false);
        readiness.set_node(flag, None);
        // Ended with the broker blocking the connection (its confirms overdue in a resource
        // alarm): a new connection would be blocked at its first publish, like this one, and
        // each would flush its own copy of what was in flight once the alarm clears. So the
        // next connection waits until this one is unblocked, seen meanwhile as blocked.
        if connection.status().blocked() && !matches!(end, SessionEnd::Shutdown) {
            tracing::warn!("the broker blocks this connection: reconnecting once it is unblocked");
            wait_unblocked(&connection, shutdown).await;
        }
        watching.abort();
        readiness.set_blocked(flag, None);
        // Bounded: on a connection that has just died, lapin can wait forever for the close-ok. A
        // blocked one writes nothing, its close included: dropped, its close is queued and goes
        // out when the alarm clears.
        if !connection.status().blocked() {
            let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "bye".into())).await;
        }
        match end {
            SessionEnd::Shutdown => return,
            SessionEnd::Lost { was_up: true } => failures = 0,
            SessionEnd::Lost { was_up: false } => {}
        }
        first = node + 1;
        let delay = backoff.delay(failures);
        failures += 1;
        if !shutdown.sleep(delay).await {
            return;
        }
    }
}
