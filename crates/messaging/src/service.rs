//! How a service runs, in three parts that every binary shares:
//!
//! - [`ServiceArgs`], the settings every binary takes (broker, HTTP address and limits), flattened
//!   into each binary's own settings, which say what else they hold through [`BinarySettings`];
//! - [`main`], what every binary's `main` does: parse the settings (from files too), exit 2 on a
//!   bad one, log, bind `HTTP_ADDR`, run until SIGINT or SIGTERM, and exit as [`exit`] says;
//! - [`Service`], how every service starts and what it runs: [`Service::start`] checks the broker's
//!   certificate, [`Service::database`] opens (creates, migrates, checks) its database, then any
//!   number of consumers (each an endpoint with its handler), other long-running loops, and HTTP
//!   routes of its own, merged with `/healthz`, `/readyz` and `/metrics`; [`Service::run`] runs
//!   them together, stops them together and closes the databases.
//!
//! [`Worker`] describes a service that consumes one endpoint (its name, database, migrations,
//! endpoint and handler) and its `main` is `my_service::worker().main()`: this module parses the
//! flags and environment and starts it as a [`Service`], as the orders API and the relay start
//! theirs, and shuts down gracefully on SIGINT or SIGTERM. `docs/adding-a-service.md` walks
//! through one, and through a service that serves routes of its own beside its consumer.

use std::{fmt, future::Future, net::SocketAddr, pin::Pin, process::ExitCode, sync::Arc};

use axum::Router;
use clap::{Args, FromArgMatches};
use messaging_core::handler::{Handler, HandlerError};
use sqlx::{PgPool, migrate::Migrator};
use tokio::net::TcpListener;

use crate::{
    consumer::{self, ConsumerArgs, ConsumerSettings},
    runtime::{
        backoff::Backoff,
        config::{BrokerArgs, SecretUrl},
        db::{self, Database, PoolSettings, SchemaArgs},
        health::{self, Health},
        metrics::Metrics,
        serve::{self, HttpArgs},
        shutdown::Shutdown,
    },
    topology::Endpoint,
};

pub use crate::runtime::startup::{BoxError, StartupError, exit};
/// The future a [`Prepare`] returns.
pub use futures_util::future::BoxFuture;

/// A service's databases, consumers, loops and routes, run together until shutdown: start-up,
/// readiness, serving and stopping, written once for every binary.
///
/// ```no_run
/// # async fn example(args: messaging::service::ServiceArgs, database: messaging::runtime::db::Database<'_>,
/// #     migrator: &sqlx::migrate::Migrator, settings: messaging::consumer::ConsumerSettings,
/// #     handler: impl messaging::handler::Handler, listener: tokio::net::TcpListener,
/// #     shutdown: messaging::runtime::shutdown::Shutdown) -> Result<(), messaging::service::BoxError> {
/// use messaging::{runtime::db::PoolSettings, service::Service};
///
/// // The broker's certificate is checked before anything is written.
/// let mut service = Service::start(&args, shutdown).await?;
/// // Created if missing, migrated, its grants checked; `None` if shutdown came first.
/// let Some(pool) = service.database("orders", database, migrator, PoolSettings::default()).await? else {
///     return Ok(());
/// };
/// // The service's own routes; the health routes are merged with them.
/// let routes = axum::Router::new().route("/hello", axum::routing::get(|| async { "hello" }));
/// service.consume(settings, handler, &pool).routes(routes).run(listener).await?;
/// # Ok(())
/// # }
/// ```
pub struct Service {
    health: Health,
    shutdown: Shutdown,
    http: HttpArgs,
    tasks: Vec<Pin<Box<dyn Future<Output = ()> + Send>>>,
    routes: Router,
}

impl fmt::Debug for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Service").field("tasks", &self.tasks.len()).finish_non_exhaustive()
    }
}

impl Service {
    /// Begin a service on `args`' broker and HTTP limits, stopping at `shutdown`: nothing runs until
    /// [`Service::run`]. A broker whose certificate does not verify stops it here, before anything
    /// is written.
    pub async fn start(args: &ServiceArgs, shutdown: Shutdown) -> Result<Self, StartupError> {
        crate::runtime::broker::check_tls(&args.broker.amqp_url).await?;
        Ok(Self {
            health: Health::default(),
            shutdown,
            http: args.http.clone(),
            tasks: Vec::new(),
            routes: Router::new(),
        })
    }

    /// Open its database: created if missing and the role may, messaging's migrations and then
    /// `migrator` applied, the runtime role's grants checked ([`db::open`]), with the server waited
    /// for while it cannot be reached. `/readyz` pings it under `label`, and it is closed once the
    /// service has stopped. `Ok(None)` if shutdown came first. (It borrows the service, where the
    /// other steps take and give it back, since it returns the pool.)
    pub async fn database(
        &mut self,
        label: &str,
        database: Database<'_>,
        migrator: &Migrator,
        settings: PoolSettings,
    ) -> Result<Option<PgPool>, StartupError> {
        let Some(pool) = db::open(database, migrator, settings, &self.shutdown).await? else {
            return Ok(None);
        };
        self.health.databases.push((label.to_owned(), pool.clone()));
        Ok(Some(pool))
    }

    /// Ping `pool` in `/readyz` under `label`, and close it once the service has stopped: a
    /// database it uses but neither creates nor migrates (the relay's outboxes).
    pub fn watch(mut self, label: &str, pool: PgPool) -> Self {
        self.health.databases.push((label.to_owned(), pool));
        self
    }

    /// Serve `metrics` on `/metrics`: the runtime's series and any the service registered in it.
    /// Before any consumer or task, which would count in the registry it replaces (it panics
    /// after one: a bug in the service).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        assert!(self.tasks.is_empty(), "with_metrics after a consumer or task: their series would not be served");
        self.health.metrics = Arc::new(metrics);
        self
    }

    /// Ready while its databases are, whatever its broker sessions do: `/readyz` only reports
    /// them. For a service that does its work without the broker, such as the API, which a load
    /// balancer must not take out while the broker is away ([`Health::broker_reported_only`]).
    pub fn ready_without_broker(mut self) -> Self {
        self.health.broker_reported_only = true;
        self
    }

    /// What `/readyz` and `/metrics` report: the routes of [`Service::routes`] serve it too.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// When it stops: for loops of its own that watch it.
    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// Consume `settings.endpoint` with `handler`, in transactions on `pool`. Not ready until the
    /// consumer is up, from the first probe on. Once per endpoint.
    pub fn consume<H: Handler>(self, settings: ConsumerSettings, handler: H, pool: &PgPool) -> Self {
        let flag = consumer::readiness_flag(&settings.endpoint);
        let consumer =
            consumer::run(settings, Arc::new(handler), pool.clone(), self.health.clone(), self.shutdown.clone());
        self.task(&flag, consumer)
    }

    /// Run `task` beside the rest until it returns (it watches the shutdown itself). Not ready
    /// until `flag` is set ready (by the task, through [`Service::health`]'s readiness).
    pub fn task(mut self, flag: &str, task: impl Future<Output = ()> + Send + 'static) -> Self {
        self.health.readiness.set(flag, false);
        self.tasks.push(Box::pin(task));
        self
    }

    /// Serve `routes` too, merged with any given before and with the health routes
    /// ([`health::routes`] of [`Service::health`]), which no service can leave out. Their paths
    /// must differ, and at most one may have a fallback (axum panics otherwise).
    pub fn routes(mut self, routes: Router) -> Self {
        self.routes = self.routes.merge(routes);
        self
    }

    /// Serve HTTP on `listener` and run every consumer and task until shutdown; returns once all
    /// have stopped (in-flight deliveries settled) and the server has closed, with the databases
    /// it opened closed.
    pub async fn run(self, listener: TcpListener) -> std::io::Result<()> {
        let Self { health, shutdown, http, tasks, routes } = self;
        // Its databases ([`Service::database`], [`Service::watch`]), closed once it has stopped.
        let pools: Vec<PgPool> = health.databases.iter().map(|(_, pool)| pool.clone()).collect();
        let timeouts = health.metrics.request_timeouts.clone();
        let routes = routes.merge(health::routes(health));
        let served = serve::serve(listener, routes, &http, shutdown, timeouts);
        // The loops run in this task (the binary's main thread), as a worker's consumer always
        // did; they spawn their handlers' work onto the runtime's threads themselves. (Spawning
        // the loops too measured no different in the bench.)
        let (served, _) = tokio::join!(served, futures_util::future::join_all(tasks));
        for pool in pools {
            pool.close().await;
        }
        served
    }
}

/// A consuming service: the parts that differ from one service to the next.
#[derive(Debug)]
pub struct Worker<F, H> {
    /// The binary's name, for `--help` and the logs, e.g. `accounts-worker`.
    pub name: &'static str,
    /// What it does, in one line, for `--help`.
    pub about: &'static str,
    /// Its version, for `--version`: `env!("CARGO_PKG_VERSION")`.
    pub version: &'static str,
    /// Its database: the name in the default `DATABASE_URL`, and its label in `/metrics` and
    /// `/readyz`.
    pub database: &'static str,
    /// The default `HTTP_ADDR` of its health and metrics endpoints.
    pub http_addr: &'static str,
    /// Its own migrations (`sqlx::migrate!("../../migrations/<service>")`), applied after
    /// messaging's.
    pub migrator: &'static Migrator,
    /// What it consumes.
    pub endpoint: Endpoint,
    /// Its handler, made from its own flags `F` ([`NoFlags`] if it has none).
    pub handler: fn(&F) -> H,
    /// HTTP routes of its own, on its database, served beside the health routes; `None` if it has
    /// none.
    pub routes: Option<fn(PgPool) -> Router>,
    /// Work done once at start-up, after the migrations and before the first delivery, as its own
    /// flags ask (the shop's workers write the demo's catalogue); `None` if it has none. An
    /// unreachable database, or an error a handler would retry, is waited out; any other failure
    /// stops the start.
    pub prepare: Option<Prepare<F>>,
}

/// A [`Worker`]'s start-up work on its database, given its own flags.
pub type Prepare<F> = for<'a> fn(&'a F, &'a PgPool) -> BoxFuture<'a, sqlx::Result<()>>;

/// Connections a [`Worker`]'s pool has for its routes, beside its consumer's.
const ROUTE_CONNECTIONS: u32 = 4;

/// The flags of a service that has none of its own.
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct NoFlags {}

/// The settings every binary takes, as flags with environment fallbacks: its broker, and where and
/// how it serves HTTP. Flattened into each binary's own settings ([`BinarySettings`]).
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceArgs {
    #[command(flatten)]
    #[allow(missing_docs)]
    pub broker: BrokerArgs,
    /// Address of its HTTP server: /healthz, /readyz and /metrics, and any routes of its own.
    /// Loopback unless told otherwise.
    // Each binary sets a default of its own (`with_http_addr`); this one is for a parse without it.
    #[arg(long, env = "HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: SocketAddr,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub http: HttpArgs,
}

/// A binary's settings: what clap parses, the [`ServiceArgs`] in them, and any check clap cannot
/// make (one that spans several settings), run before any server is touched.
pub trait BinarySettings: FromArgMatches {
    /// The settings every binary takes.
    fn service(&self) -> &ServiceArgs;

    /// Why these settings cannot run, if they cannot: [`main`] exits 2 with the reason.
    fn check(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The settings of a service on one database that consumes, as flags with environment fallbacks:
/// every worker's, and the orders API's beside its own. Its `DATABASE_URL`'s default names the
/// service's database ([`with_database`]).
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// Postgres URL of its database, as its runtime role (created, if missing and the role may,
    /// and migrated at start-up). TLS: `?sslmode=verify-full&sslrootcert=/run/ca.pem`.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: SecretUrl,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub schema: SchemaArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub service: ServiceArgs,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub consumer: ConsumerArgs,
}

/// A worker's parsed settings: the common ones and its own.
#[derive(Debug, Clone)]
pub struct Settings<F> {
    /// What every worker takes.
    pub common: WorkerArgs,
    /// The service's own flags.
    pub own: F,
}

impl<F: FromArgMatches> FromArgMatches for Settings<F> {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        Ok(Self { common: WorkerArgs::from_arg_matches(matches)?, own: F::from_arg_matches(matches)? })
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        self.common.update_from_arg_matches(matches)?;
        self.own.update_from_arg_matches(matches)
    }
}

impl<F: FromArgMatches> BinarySettings for Settings<F> {
    fn service(&self) -> &ServiceArgs {
        &self.common.service
    }

    fn check(&self) -> Result<(), String> {
        self.common.consumer.check()
    }
}

impl<F: Args + FromArgMatches, H: Handler> Worker<F, H> {
    /// Its command line: every worker's flags and its own, with its defaults.
    pub fn command(&self) -> clap::Command {
        let command = clap::Command::new(self.name).about(self.about).version(self.version);
        with_database(with_http_addr(F::augment_args(WorkerArgs::augment_args(command)), self.http_addr), self.database)
    }

    /// Parse `args` (the first is the binary's name), checked as [`main`] checks them.
    pub fn try_parse_from<I, T>(&self, args: I) -> Result<Settings<F>, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        parse(self.command(), args)
    }

    /// Run until `shutdown`: its routes and the health endpoints on `listener`, the consumer in the
    /// foreground.
    /// Returns once in-flight deliveries are settled and the HTTP server has stopped; an error only
    /// if it cannot start ([`StartupError`]: a certificate, credentials, a grant, a migration).
    pub async fn run(
        self,
        settings: Settings<F>,
        listener: TcpListener,
        shutdown: Shutdown,
    ) -> Result<(), StartupError> {
        let Settings { common, own } = settings;
        let mut service = Service::start(&common.service, shutdown).await?;
        let consumer = ConsumerSettings::from_args(self.endpoint, &common.consumer, &common.service.broker);
        // One connection per concurrent delivery, plus one for health checks, and a few for its
        // routes, if it has any: a burst of requests must not take the consumer's connections,
        // which it would wait out as an outage.
        let for_routes = if self.routes.is_some() { ROUTE_CONNECTIONS } else { 0 };
        let pool_settings = PoolSettings {
            max_connections: u32::from(consumer.prefetch) + 1 + for_routes,
            timeouts: common.schema.timeouts,
            ..PoolSettings::default()
        };
        let database = common.schema.database(&common.database_url);
        let Some(pool) = service.database(self.database, database, self.migrator, pool_settings).await? else {
            return Ok(());
        };
        if let Some(prepare) = self.prepare
            && !prepared(prepare, &own, &pool, service.shutdown()).await?
        {
            pool.close().await;
            return Ok(());
        }
        let mut service = service.consume(consumer, (self.handler)(&own), &pool);
        if let Some(routes) = self.routes {
            service = service.routes(routes(pool.clone()));
        }
        if let Err(error) = service.run(listener).await {
            tracing::error!(%error, "HTTP server failed");
        }
        Ok(())
    }

    /// What a worker binary's `main` does: [`main`], running the worker.
    pub fn main(self) -> ExitCode
    where
        F: Send + 'static,
    {
        let (name, command) = (self.name, self.command());
        main(name, command, |settings, listener, shutdown| async move {
            self.run(settings, listener, shutdown).await.map_err(BoxError::from)
        })
    }
}

/// Run `prepare` on `pool` until it succeeds: an unreachable database, and what a handler's error
/// would retry (a lock waited for too long, a deadlock, a cancelled statement), are tried again
/// with backoff. `Ok(false)` if shutdown came first, a [`StartupError`] if the database refused it
/// on its merits.
async fn prepared<F>(prepare: Prepare<F>, own: &F, pool: &PgPool, shutdown: &Shutdown) -> Result<bool, StartupError> {
    let backoff = Backoff::default();
    let mut failures = 0;
    loop {
        let error = match db::within(db::QUERY_DEADLINE, prepare(own, pool)).await {
            Ok(()) => return Ok(true),
            Err(error) => error,
        };
        let described = db::describe(&error);
        if let HandlerError::Permanent(_) = HandlerError::from(error) {
            return Err(StartupError(format!("preparing the database: {described}")));
        }
        let delay = backoff.delay(failures);
        tracing::warn!(error = %described, ?delay, "cannot prepare the database yet; retrying");
        failures += 1;
        if !shutdown.sleep(delay).await {
            return Ok(false);
        }
    }
}

/// `command` with `default` as its `HTTP_ADDR`'s default: each binary has its own port. Panics
/// if `command` has no `http_addr` ([`ServiceArgs`] has).
pub fn with_http_addr(command: clap::Command, default: &'static str) -> clap::Command {
    command.mut_arg("http_addr", |arg| arg.default_value(default).required(false))
}

/// `command` with `postgres://postgres@localhost:5432/<database>` as its `DATABASE_URL`'s default.
/// Panics if `command` has no single `database_url` ([`WorkerArgs`] has).
pub fn with_database(command: clap::Command, database: &str) -> clap::Command {
    let url = format!("postgres://postgres@localhost:5432/{database}");
    command.mut_arg("database_url", |arg| arg.default_value(url).required(false))
}

/// What every binary's `main` does: parse its settings `S` from the command line (settings given
/// in files too), checked ([`BinarySettings::check`]); on a bad one, exit 2 with the reason before
/// touching any server. Then log to stderr and, on a multi-threaded runtime, bind `HTTP_ADDR` and
/// run `run` until SIGINT or SIGTERM; end as [`exit`] says.
///
/// ```no_run
/// # #[derive(clap::Parser)] struct Config { #[command(flatten)] service: messaging::service::ServiceArgs }
/// # impl messaging::service::BinarySettings for Config { fn service(&self) -> &messaging::service::ServiceArgs { &self.service } }
/// # async fn run(_: Config, _: tokio::net::TcpListener, _: messaging::runtime::shutdown::Shutdown) -> Result<(), messaging::service::BoxError> { Ok(()) }
/// use clap::CommandFactory;
/// use messaging::service;
///
/// fn main() -> std::process::ExitCode {
///     let command = service::with_http_addr(Config::command(), "127.0.0.1:8090");
///     service::main("my-service", command, run)
/// }
/// ```
pub fn main<S, F, Fut>(name: &str, command: clap::Command, run: F) -> ExitCode
where
    S: BinarySettings,
    F: FnOnce(S, TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), BoxError>>,
{
    let args = command_line(&command);
    let settings: S = match parse(command, args) {
        Ok(settings) => settings,
        Err(error) => error.exit(),
    };
    let _telemetry = crate::runtime::telemetry::init(name);
    let addr = settings.service().http_addr;
    run_binary(name, addr, |listener, shutdown| run(settings, listener, shutdown))
}

/// `args` parsed by `command` into `S`, and checked.
fn parse<S, I, T>(mut command: clap::Command, args: I) -> Result<S, clap::Error>
where
    S: BinarySettings,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = command.try_get_matches_from_mut(args)?;
    let settings = S::from_arg_matches(&matches)?;
    match settings.check() {
        Ok(()) => Ok(settings),
        Err(refusal) => Err(command.error(clap::error::ErrorKind::ValueValidation, refusal)),
    }
}

/// The process's command line for `command`, with the settings given in files
/// ([`crate::runtime::config::args_with_secret_files`]); exits 2 with the reason if one cannot be read.
pub fn command_line(command: &clap::Command) -> Vec<std::ffi::OsString> {
    match crate::runtime::config::args_with_secret_files(command, std::env::args_os()) {
        Ok(args) => args,
        Err(refusal) => command.clone().error(clap::error::ErrorKind::ValueValidation, refusal).exit(),
    }
}

/// What a binary's `main` does once its flags are parsed: on a multi-threaded runtime, bind
/// `addr`, run the service until SIGINT or SIGTERM ([`run_until_signal`]), and end as [`exit`]
/// says.
fn run_binary<F, Fut>(name: &str, addr: SocketAddr, run: F) -> ExitCode
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), BoxError>>,
{
    crate::runtime::failpoint::warn_if_ignored();
    let outcome = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BoxError::from)
        .and_then(|runtime| runtime.block_on(run_until_signal(addr, run)));
    exit(name, outcome)
}

/// What every binary's `main` does after parsing its flags: bind `addr`, turn SIGINT/SIGTERM into
/// a shutdown, and run the service on the listener until it returns.
async fn run_until_signal<F, Fut, E>(addr: SocketAddr, run: F) -> Result<(), E>
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: From<std::io::Error>,
{
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "listening");
    let (trigger, shutdown) = crate::runtime::shutdown::channel();
    tokio::spawn(async move {
        crate::runtime::shutdown::signal().await;
        trigger.trigger();
    });
    run(listener, shutdown).await
}
