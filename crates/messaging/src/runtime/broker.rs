//! Broker connections. lapin does not recover lost connections reliably by itself, so every
//! long-running loop in this workspace owns a "session": connect, declare, work until the
//! connection fails, then reconnect here with backoff. Nothing is acked or marked published on a
//! connection that failed, so what was in flight is redelivered or republished by the next session.

use std::{sync::Arc, time::Duration};

use lapin::{Connection, ConnectionProperties, DefaultConnectionBuilder};

use crate::runtime::{backoff::Backoff, config::SecretUrl, health::Readiness, shutdown::Shutdown, tls::TlsFiles};

/// A long-running broker client: where it connects, its name (shown in the broker's management
/// UI, and the readiness flag that says whether it is up), and how long it waits between tries.
#[derive(Debug, Clone)]
pub struct Link {
    /// The broker.
    pub url: SecretUrl,
    /// e.g. `consumer:accounts.user-registered`, `relay:accounts`.
    pub name: String,
    /// Between connection attempts.
    pub backoff: Backoff,
    /// Where its readiness flag (`name`) lives.
    pub readiness: Arc<Readiness>,
}

/// Open one connection, named `name` in the broker's management UI. An `amqps://` URL may name
/// its CA file and client certificate in its query ([`crate::runtime::tls`]); they are read at every
/// connect, so a rotated certificate is picked up by the next reconnect.
pub async fn connect(url: &SecretUrl, name: &str) -> lapin::Result<Connection> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let parsed = url::Url::parse(url.expose())
        .map_err(|error| lapin::Error::from(std::io::Error::new(std::io::ErrorKind::InvalidInput, error)))?;
    let files = TlsFiles::of_url(&parsed);
    let tls = files.amqp().map_err(lapin::Error::from)?;
    DefaultConnectionBuilder::new()?
        .with_uri_str(TlsFiles::strip(&parsed).into())
        .with_properties(properties)
        .with_tls_config(tls)
        .connect()
        .await
}

/// At start-up, before anything is written: one connection to the broker. A certificate that
/// does not verify, or TLS files that cannot be read, is an error naming the broker and the
/// reason, which no retry would cure. Anything else (the broker not up yet) is left to the
/// sessions' reconnect loops.
pub async fn check_tls(url: &SecretUrl) -> Result<(), crate::runtime::startup::StartupError> {
    match tokio::time::timeout(Duration::from_secs(10), connect(url, "start-up check")).await {
        Ok(Ok(connection)) => {
            let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "checked".into())).await;
            Ok(())
        }
        Ok(Err(error)) => match crate::runtime::tls::verification_failure(&error) {
            Some(reason) => Err(crate::runtime::startup::StartupError(format!("the broker at {url}: TLS: {reason}"))),
            None => Ok(()),
        },
        Err(_) => Ok(()),
    }
}

/// Connect, retrying with backoff until it works or shutdown is asked for (`None`).
pub async fn connect_with_backoff(
    url: &SecretUrl,
    name: &str,
    backoff: Backoff,
    shutdown: &Shutdown,
) -> Option<Connection> {
    let mut failures = 0;
    loop {
        if shutdown.is_triggered() {
            return None;
        }
        match connect(url, name).await {
            Ok(connection) => return Some(connection),
            Err(error) => {
                let delay = backoff.delay(failures);
                tracing::warn!(%error, %url, ?delay, "cannot reach the broker; retrying");
                failures += 1;
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
    /// Work on `connection`; set the link's readiness flag once up.
    fn run(&mut self, connection: &Connection) -> impl std::future::Future<Output = SessionEnd> + Send;
}

/// The reconnect loop every long-running broker client uses: connect (with the link's backoff),
/// run `session` on the connection, close it, and start again after a backoff until a session
/// ends with [`SessionEnd::Shutdown`] or shutdown is asked for. The link's readiness flag is
/// cleared after every session (the session sets it once it is up).
pub async fn run_sessions(link: &Link, shutdown: &Shutdown, session: &mut impl Session) {
    let (readiness, flag, backoff) = (&link.readiness, link.name.as_str(), link.backoff);
    readiness.set(flag, false);
    let mut failures = 0;
    while let Some(connection) = connect_with_backoff(&link.url, flag, backoff, shutdown).await {
        let end = session.run(&connection).await;
        readiness.set(flag, false);
        // Bounded: on a connection that has just died, lapin can wait forever for the close-ok.
        let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "bye".into())).await;
        match end {
            SessionEnd::Shutdown => return,
            SessionEnd::Lost { was_up: true } => failures = 0,
            SessionEnd::Lost { was_up: false } => {}
        }
        let delay = backoff.delay(failures);
        failures += 1;
        if !shutdown.sleep(delay).await {
            return;
        }
    }
}
