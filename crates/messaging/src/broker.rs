//! Broker connections. lapin does not recover lost connections reliably by itself, so every
//! long-running loop in this workspace owns a "session": connect, declare, work until the
//! connection fails, then reconnect here with backoff. Nothing is acked or marked published on a
//! connection that failed, so what was in flight is redelivered or republished by the next session.

use lapin::{Connection, ConnectionProperties};

use crate::{backoff::Backoff, config::SecretUrl, shutdown::Shutdown};

/// Open one connection, named `name` in the broker's management UI.
pub async fn connect(url: &SecretUrl, name: &str) -> lapin::Result<Connection> {
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    Connection::connect(url.expose(), properties).await
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
