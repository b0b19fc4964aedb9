//! `orders-api`: the HTTP API that accepts orders (writing order, job and `order.placed` outbox row
//! in one transaction) and reports jobs, plus the orders status consumer that moves jobs to their
//! final state. Both live in one process and share the `orders` database.

pub mod api;
pub mod auth;
pub mod books;
pub mod console;
pub mod group_commit;
pub mod jobs;
pub mod moves;
pub mod openapi;
pub mod order;
pub mod overview;
pub mod place;
pub mod problem;
pub mod responses;
pub mod status;
mod stored;
pub mod story;
pub mod upgrade;

use std::sync::Arc;

use axum::Router;
use messaging::{
    consumer::ConsumerSettings,
    runtime::{config::SecretUrl, db::PoolSettings, metrics::Metrics, shutdown::Shutdown},
    service::{BinarySettings, BoxError, Service, ServiceArgs, WorkerArgs},
};
use sqlx::PgPool;

/// This service's own migrations (`migrations/orders`), applied after messaging's.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/orders");

/// `orders-api`: accepts orders and reports their jobs.
#[derive(Debug, Clone, clap::Parser)]
#[command(version, about)]
pub struct Config {
    /// What every consuming service on one database takes: its database, broker, HTTP and
    /// consumer settings.
    #[command(flatten)]
    pub common: WorkerArgs,
    /// The live page (`GET /`) and its data (`GET /overview`, for operators' tokens only; the page
    /// takes one from its address, `/#token=…`): `off` removes both routes.
    #[arg(long, env = "LIVE_PAGE", default_value = "on", value_parser = ["on", "off"])]
    pub live_page: String,
    /// Database connections for requests and the status consumer.
    #[arg(long, env = "DATABASE_POOL_SIZE", default_value_t = 20)]
    pub pool_size: u32,
    /// Write the orders that arrive together in one statement (group commit, decision 0009)
    /// instead of each in a transaction of its own: one round trip and one commit for several
    /// orders, each with its own outcome (1/0, true/false).
    #[arg(long, env = "ORDER_GROUP_COMMIT", default_value = "false", action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub order_group_commit: bool,
    /// With group commit: tasks writing accepted orders, each one statement at a time; the orders
    /// that arrive while all are busy share their next statement. Each holds a connection of the
    /// pool while it writes.
    #[arg(long, env = "ORDER_WRITERS", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub order_writers: u16,
    /// The largest body, in bytes, of the messages an order causes (its `order.placed`, and the
    /// `inventory.reserved` that carries the same lines): a larger order is refused with 413 before
    /// anything is written. Keep it under the broker's `max_message_size` (16 MiB by default on
    /// RabbitMQ 4.x), which would refuse the message for good.
    #[arg(long, env = "MAX_MESSAGE_BYTES", default_value_t = 1024 * 1024, value_parser = clap::value_parser!(u32).range(256..))]
    pub max_message_bytes: u32,
    /// How long an order may take: one that has not ended by then (invoiced, rejected or
    /// declined) is cancelled and compensated (`order.deadline`, decision 0023). Billing declines
    /// a reservation that reaches it after the deadline.
    #[arg(long, env = "ORDER_DEADLINE", default_value = "30m", value_parser = messaging::runtime::duration::parse_duration)]
    pub order_deadline: std::time::Duration,
    /// The other services' /metrics, comma-separated, for the live page's per-endpoint counts and
    /// outbox backlogs (this service's own are always included).
    #[arg(long, env = "SHOP_METRICS_URLS", value_delimiter = ',')]
    pub shop_metrics_urls: Vec<String>,
    /// The RabbitMQ management API (`http://user:password@host:15672`), for the live page's
    /// parking depths; none if unset.
    #[arg(long, env = "RABBITMQ_MANAGEMENT_URL", hide_env_values = true)]
    pub rabbitmq_management_url: Option<SecretUrl>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub books: books::BooksArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub auth: auth::AuthArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub console: console::ConsoleArgs,
    /// Where an order's trace is shown, `{traceId}` standing for its id (Jaeger's:
    /// `http://127.0.0.1:16686/trace/{traceId}`): `GET /jobs/{id}/events` gives the link as
    /// `traceUrl`, and the live page's timeline shows it. None if unset.
    #[arg(long, env = "TRACE_VIEW_URL")]
    pub trace_view_url: Option<story::TraceView>,
}

impl BinarySettings for Config {
    fn service(&self) -> &ServiceArgs {
        &self.common.service
    }

    fn check(&self) -> Result<(), String> {
        self.common.consumer.check()?;
        if let Some(console) = &self.console.console_amqp_url {
            if self.live_page == "off" {
                return Err("CONSOLE_AMQP_URL is set, but LIVE_PAGE=off removes the console with the live page".into());
            }
            let own = self.common.service.broker.amqp_url.vhost();
            if console.vhost() != own {
                return Err(format!(
                    "CONSOLE_AMQP_URL names vhost `{}`, but AMQP_URL vhost `{own}`: the console acts on this \
                     service's vhost",
                    console.vhost()
                ));
            }
        }
        self.auth.auth().map(drop)
    }
}

/// The API's own HTTP surface: API routes, the live page (unless `page` is `None`), the OpenAPI
/// document, problem+json 404s, tracing and failure logs. The service runtime merges the health
/// routes with it.
pub fn app(
    pool: PgPool,
    writer: place::Writer,
    limits: api::Limits,
    auth: auth::Auth,
    page: Option<overview::Sources>,
) -> Router {
    let api = api::router(pool, writer, limits, auth);
    let api = match page {
        Some(page) => api.merge(overview::routes(page)),
        None => api,
    };
    api.merge(openapi::routes())
        .fallback(api::no_route)
        .layer(axum::middleware::from_fn(problem::log_failures))
        // No failure log here: `log_failures` logs a failed request once, with its cause. (The
        // health routes, merged by the service runtime, are outside both layers: a 503 from
        // /readyz is a state, logged when it changes, `Readiness::set`.)
        .layer(messaging::runtime::serve::trace_requests())
}

/// The console of parked messages, if `CONSOLE_AMQP_URL` is set. It reads the inboxes of this
/// database and, through the books' read-only role, of inventory's and billing's: where those
/// cannot be reached, their messages' verdicts say the inbox was not read.
fn console(config: &Config, orders: &PgPool, auth: &auth::Auth) -> Option<console::Console> {
    let amqp_url = config.console.console_amqp_url.clone()?;
    let mut inboxes = vec![orders.clone()];
    match books::reader_urls(&config.books, &config.common.database_url) {
        Ok(urls) => {
            for url in [urls.0, urls.1] {
                match shop_books::read_only(url.expose(), std::time::Duration::from_secs(5)) {
                    Ok(pool) => inboxes.push(pool),
                    Err(error) => tracing::warn!(%url, %error, "the console cannot read this inbox"),
                }
            }
        }
        Err(error) => tracing::warn!(%error, "the console reads no other service's inbox (BOOKS_*_URL)"),
    }
    let retention = config.common.consumer.inbox_retention;
    let inboxes = msgctl::parked::Inboxes::of_pools(inboxes);
    Some(console::Console::new(amqp_url, config.rabbitmq_management_url.clone(), inboxes, retention, auth.clone()))
}

/// Run the API on `listener` and the status consumer until `shutdown`.
pub async fn run(config: Config, listener: tokio::net::TcpListener, shutdown: Shutdown) -> Result<(), BoxError> {
    let WorkerArgs { database_url, schema, service: service_args, consumer } = &config.common;
    // Checked by `check` at start-up as well.
    let auth = config.auth.auth()?;
    let broker = &service_args.broker;
    let mut metrics = Metrics::default();
    let batches = group_commit::BatchMetrics::register(&mut metrics);
    let books_metrics = books::BooksMetrics::register(&mut metrics);
    let forbidden_moves = moves::ForbiddenMoves::register(&mut metrics);
    let responses = responses::ResponseMetrics::register(&mut metrics);
    // Ready while its database takes orders: a load balancer must not take the API out while the
    // broker is away, since the outbox keeps what it accepts meanwhile (issue 56, row 2).
    let mut service = Service::start(service_args, shutdown).await?.with_metrics(metrics).ready_without_broker();
    let settings = PoolSettings {
        max_connections: config.pool_size,
        // Fail fast into a 503 while the database is down, rather than hanging the client.
        acquire_timeout: std::time::Duration::from_secs(2),
        timeouts: schema.timeouts,
        // A stalled database found at the acquire, within those 2 s, not at the query deadline.
        // (Not by the status consumer's kept connection: its handler deadline finds it.)
        check_each_acquire: true,
    };
    let Some(pool) = service.database("orders", schema.database(database_url), &MIGRATOR, settings).await? else {
        return Ok(());
    };
    let status = ConsumerSettings::from_args(status::endpoint(), consumer, broker);
    let handler = status::handler(status::JobStatus { metrics: Arc::clone(&service.health().metrics) });
    let shutdown = service.shutdown().clone();
    books::start(&config.books, database_url, config.order_deadline, pool.clone(), books_metrics, shutdown.clone())?;
    upgrade::start(pool.clone(), config.order_deadline, shutdown.clone());
    moves::start(pool.clone(), forbidden_moves, shutdown);
    let service = service.consume(status, handler, &pool);
    let health = service.health().clone();
    let page = (config.live_page == "on").then(|| {
        overview::Sources::new(
            pool.clone(),
            health.clone(),
            config.shop_metrics_urls.iter().filter(|url| !url.is_empty()).cloned().collect(),
            config.rabbitmq_management_url.clone().map(|url| (url, broker.amqp_url.management_queues_path())),
            auth.clone(),
        )
        .with_console(console(&config, &pool, &auth))
    });
    let writer = if config.order_group_commit {
        place::Writer::Grouped(group_commit::Writers::start(pool.clone(), config.order_writers.into(), batches))
    } else {
        place::Writer::Alone(pool.clone())
    };
    let limits =
        api::Limits { max_message_bytes: config.max_message_bytes as usize, order_deadline: config.order_deadline };
    let mut app = app(pool.clone(), writer, limits, auth, page);
    if let Some(view) = config.trace_view_url.clone() {
        app = app.layer(axum::Extension(view));
    }
    let app = app.layer(axum::middleware::from_fn_with_state(responses, responses::count));
    service.routes(app).run(listener).await?;
    Ok(())
}
