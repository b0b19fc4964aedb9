//! How a consuming service runs: open its database, serve its health endpoints, run its consumer
//! until shutdown. Both workers are exactly this with a different handler.

use std::sync::Arc;

use sqlx::migrate::Migrator;
use tokio::net::TcpListener;

use crate::{
    config::SecretUrl,
    consumer::{self, ConsumerSettings, Handler},
    db::{self, PoolSettings},
    health::{self, Health},
    shutdown::Shutdown,
};

/// A service that consumes one endpoint.
pub struct Worker<H> {
    /// Its own database.
    pub database_url: SecretUrl,
    /// Its migrations.
    pub migrator: &'static Migrator,
    /// The label of its database in `/metrics` and `/readyz`.
    pub database_label: &'static str,
    /// Its endpoint, retry policy, prefetch and broker.
    pub consumer: ConsumerSettings,
    /// What it does with a message.
    pub handler: H,
}

impl<H: Handler> Worker<H> {
    /// Run until `shutdown`: health endpoints on `listener`, the consumer in the foreground. Returns
    /// once in-flight deliveries are settled and the HTTP server has stopped.
    pub async fn run(self, listener: TcpListener, shutdown: Shutdown) -> Result<(), sqlx::Error> {
        // One connection per concurrent delivery, plus one for health checks.
        let pool_settings =
            PoolSettings { max_connections: u32::from(self.consumer.prefetch) + 1, ..PoolSettings::default() };
        let Some(pool) = db::open(&self.database_url, self.migrator, pool_settings, &shutdown).await? else {
            return Ok(());
        };
        let health = Health { databases: vec![(self.database_label.to_owned(), pool.clone())], ..Health::default() };
        let server = tokio::spawn(health::serve(listener, health::routes(health.clone()), shutdown.clone()));
        consumer::run(self.consumer, Arc::new(self.handler), pool.clone(), health, shutdown).await;
        match server.await {
            Ok(Err(error)) => tracing::error!(%error, "health server failed"),
            Err(error) => tracing::error!(%error, "health server task failed"),
            Ok(Ok(())) => {}
        }
        pool.close().await;
        Ok(())
    }
}

/// The exit code of a worker that a `CRASH` SKU brings down (`EX_SOFTWARE`), distinct from a
/// panic's 101, so that a supervisor or a soak can tell the demo's crashes from real ones.
pub const DEMO_CRASH_EXIT_CODE: i32 = 70;

/// Demo fault injection (`DEMO_FAULTS=1`, DESIGN §8): a line whose SKU starts with `FLAKY` fails
/// transiently on the first two attempts; one starting with `POISON` fails on every attempt (a
/// simulated handler bug), so its message is parked after `MAX_ATTEMPTS`; one starting with
/// `CRASH` makes the process exit at once, every time (a handler that crashes), so its message is
/// parked by the crash bound (`MAX_CRASHES`). Never call it in a test process: it would exit.
pub fn demo_fault<'a>(
    skus: impl IntoIterator<Item = &'a str>,
    attempt: u32,
) -> Result<(), crate::consumer::HandlerError> {
    use crate::consumer::HandlerError;
    for sku in skus {
        if sku.starts_with("CRASH") {
            // Like a segfault or an OOM kill: no unwinding, no ack, nothing flushed but this line.
            eprintln!("demo fault: {sku} crashes the worker (attempt {attempt})");
            std::process::exit(DEMO_CRASH_EXIT_CODE);
        }
        if sku.starts_with("POISON") {
            return Err(HandlerError::Transient(format!("demo fault: {sku} always fails (attempt {attempt})")));
        }
        if sku.starts_with("FLAKY") && attempt <= 2 {
            return Err(HandlerError::Transient(format!("demo fault: {sku} fails on attempt {attempt} of 3")));
        }
    }
    Ok(())
}

/// What every binary's `main` does after parsing its flags: bind `addr`, turn SIGINT/SIGTERM into
/// a shutdown, and run the service on the listener until it returns.
pub async fn run_until_signal<F, Fut, E>(addr: std::net::SocketAddr, run: F) -> Result<(), E>
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: std::future::Future<Output = Result<(), E>>,
    E: From<std::io::Error>,
{
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "listening");
    let (trigger, shutdown) = crate::shutdown::channel();
    tokio::spawn(async move {
        crate::shutdown::signal().await;
        trigger.trigger();
    });
    run(listener, shutdown).await
}
