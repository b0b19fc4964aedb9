//! A consumer's check that the broker can still take a write for its endpoint. A quorum queue
//! that has lost its majority gives a consumer whose session outlived the loss neither deliveries
//! nor an error: nothing on its connection tells the loss from an idle queue. So each session
//! publishes an empty message to the endpoint's probe queue (`<endpoint>.probe`, a quorum queue
//! that keeps only the newest) every [`EVERY`], and waits up to `CONFIRM_TIMEOUT` for its confirm,
//! which the queue gives once a majority of its members wrote it. While a probe's confirm is
//! overdue, or it is nacked, on a connection the broker does not block, the consumer reads not
//! ready (`overdueConfirms`), through every reconnect, until a probe is confirmed again.

use std::{sync::Arc, time::Duration};

use lapin::{BasicProperties, Connection};

use crate::{
    publisher::{PublishError, Publisher},
    runtime::health::Readiness,
    topology::Endpoint,
};

/// How often a session probes.
pub(super) const EVERY: Duration = Duration::from_secs(5);

/// Probe on `connection` (the session's publishing one) until aborted, marking link `flag`'s
/// confirms overdue in `readiness` as they go.
pub(super) fn spawn(
    connection: Arc<Connection>,
    endpoint: &Endpoint,
    confirm_timeout: Duration,
    readiness: Arc<Readiness>,
    flag: String,
) -> tokio::task::JoinHandle<()> {
    let (exchange, queue) = (endpoint.direct_exchange(), endpoint.probe_queue());
    tokio::spawn(async move {
        let mut publisher: Option<Publisher> = None;
        loop {
            if publisher.is_none() {
                let opened = tokio::time::timeout(confirm_timeout, Publisher::open(&connection)).await;
                publisher = opened.ok().and_then(Result::ok).map(|opened| opened.with_confirm_timeout(confirm_timeout));
            }
            if let Some(probe) = &publisher {
                match probe.publish(&exchange, &queue, b"", BasicProperties::default()).await {
                    Ok(()) => readiness.set_overdue(&flag, false),
                    // A blocked connection is an alarm, which readiness names already.
                    Err(PublishError::TimedOut(_) | PublishError::Nacked) => {
                        if !connection.status().blocked() {
                            readiness.set_overdue(&flag, true);
                        }
                    }
                    // A closed channel: a fresh one next time; a lost connection ends the session.
                    Err(error) => {
                        tracing::debug!(%error, "probe failed; a fresh channel next time");
                        publisher = None;
                    }
                }
            }
            tokio::time::sleep(EVERY).await;
        }
    })
}
