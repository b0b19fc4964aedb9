//! `orders-api`: the HTTP API that accepts orders (writing order, job and `order.placed` outbox row
//! in one transaction) and reports jobs, plus the orders status consumer that moves jobs to their
//! final state. Both live in one process and share the `orders` database.

pub mod api;
pub mod problem;
pub mod status;

use std::{net::SocketAddr, sync::Arc};

use axum::Router;
use messaging::{
    config::{BrokerArgs, ConsumerArgs, SecretUrl},
    consumer,
    db::{self, PoolSettings},
    health::{self, Health},
    shutdown::Shutdown,
};
use sqlx::PgPool;
use tower_http::trace::TraceLayer;

/// This service's migrations (`migrations/orders`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/orders");

/// `orders-api`: accepts orders and reports their jobs.
#[derive(Debug, Clone, clap::Parser)]
#[command(version, about)]
pub struct Config {
    /// Postgres URL of the orders database (created and migrated at start-up).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@localhost:5432/orders"
    )]
    pub database_url: SecretUrl,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub broker: BrokerArgs,
    /// Address of the API (and its /healthz, /readyz, /metrics).
    #[arg(long, env = "HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Database connections for requests and the status consumer.
    #[arg(long, env = "DATABASE_POOL_SIZE", default_value_t = 20)]
    pub pool_size: u32,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub consumer: ConsumerArgs,
}

/// The whole HTTP surface: API routes, health routes, problem+json 404s, tracing and failure logs.
pub fn app(pool: PgPool, health: Health) -> Router {
    api::router(pool)
        .merge(health::routes(health))
        .fallback(api::no_route)
        .layer(axum::middleware::from_fn(problem::log_failures))
        .layer(TraceLayer::new_for_http())
}

/// Run the API on `listener` and the status consumer until `shutdown`.
pub async fn run(config: Config, listener: tokio::net::TcpListener, shutdown: Shutdown) -> anyhow::Result<()> {
    let settings = PoolSettings {
        max_connections: config.pool_size,
        // Fail fast into a 503 while the database is down, rather than hanging the client.
        acquire_timeout: std::time::Duration::from_secs(2),
    };
    let Some(pool) = db::open(&config.database_url, &MIGRATOR, settings, &shutdown).await? else {
        return Ok(());
    };
    let health = Health { databases: vec![("orders".to_owned(), pool.clone())], ..Health::default() };
    let status = config.consumer.settings(status::endpoint(), &config.broker);
    let consumer = tokio::spawn(consumer::run(
        status,
        Arc::new(status::JobStatus),
        pool.clone(),
        health.clone(),
        shutdown.clone(),
    ));
    let served = health::serve(listener, app(pool.clone(), health), shutdown).await;
    let _ = consumer.await;
    pool.close().await;
    served?;
    Ok(())
}
