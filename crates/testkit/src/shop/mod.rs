//! The test harness: the whole shop on a private [`TestEnv`], with one set of helpers (place
//! orders, read jobs, wait for states, read metrics, settle and read the books) however it runs.
//!
//! - [`Shop::start`]: every service as a real process, each reaching Postgres and RabbitMQ
//!   through its own pair of fault [`Proxy`]s. The crash and fault tests and the `chaos` soak.
//!   With [`Options::instances`] above 1, several of each: the APIs behind one [`Balancer`] (the
//!   shop's [`Shop::front`]), relays over the same databases, workers on the same queues.
//! - [`Shop::in_process`]: the services as tasks of the test process, started by the caller (the
//!   suites' `tests/common`, which link the service crates), for tests that need no process to
//!   die. Process-only helpers (kill, restart, proxies, logs) panic on such a shop.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use messaging::{runtime::shutdown::ShutdownTrigger, service::BoxError};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::{
    TestEnv, ledger,
    process::{self, Process},
    proxy::{Balancer, Proxy},
};

mod orders;

pub use orders::CUSTOMER;

pub use crate::services::{Instance, Service};

/// Knobs of a shop.
#[derive(Debug, Clone)]
pub struct Options {
    /// `RETRY_DELAYS` of the consumers.
    pub retry_delays: String,
    /// `MAX_ATTEMPTS` of the consumers.
    pub max_attempts: u32,
    /// `PREFETCH` of the consumers.
    pub prefetch: u16,
    /// `DEMO_FAULTS` of the workers (FLAKY-1 and POISON-1).
    pub demo_faults: bool,
    /// `RUST_LOG` of the services.
    pub log_filter: String,
    /// More variables for the three consumers (the API's status consumer and both workers), such
    /// as `MAX_CRASHES` or `DELIVERY_LIMIT`.
    pub consumer_env: Vec<(&'static str, String)>,
    /// More variables for the relay, such as `RELAY_MAX_ATTEMPTS`.
    pub relay_env: Vec<(&'static str, String)>,
    /// Each service under its own least-privilege database roles and broker user, made by the
    /// DBA's scripts ([`crate::roles`]), its URLs given as files (`DATABASE_URL_FILE`, ...).
    pub least_privilege: bool,
    /// How many broker nodes each service's `AMQP_URL` names at least: each is a proxy of its own
    /// to one of the test broker's nodes (taken in turn, so with a one-node broker all go to it),
    /// and a test can take one "node" away from a service. A cluster's nodes are all named anyway.
    pub broker_nodes: usize,
    /// How many instances of each service run (1 or more): the APIs behind one load balancer,
    /// which [`Shop::front`] names, the relays over the same databases, the workers consuming the
    /// same queues. Each instance has its own proxies.
    pub instances: usize,
    /// The Postgres every database is on (`postgres://user@host:port`), if not the run's: e.g. a
    /// highly available pair's address ([`crate::patroni::Patroni::url`]).
    pub postgres: Option<String>,
    /// Whether the binaries are a test build, with the failpoints and the demo's faults (decision
    /// 0025): checked once they are ready, from `build_info`, so that a binary a default build
    /// (`cargo build -p inventory-worker`) left in the target directory fails the test at its
    /// start, with the cause, instead of at its first failpoint.
    pub test_build: bool,
    /// Where the services' binaries are, if not this build's: another release's, for the upgrade
    /// suite ([`Shop::upgrade`] moves a service to a later release's, or to this build's). Such a
    /// shop's build is not checked (`test_build`): a release before decision 0025 reports none.
    pub bin_dir: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            retry_delays: "100ms,300ms".into(),
            max_attempts: 5,
            prefetch: 8,
            demo_faults: false,
            log_filter: "info".into(),
            consumer_env: Vec::new(),
            relay_env: Vec::new(),
            least_privilege: false,
            broker_nodes: 1,
            instances: 1,
            postgres: None,
            test_build: true,
            bin_dir: None,
        }
    }
}

impl Options {
    /// The flags of a consumer (the API's status consumer or a worker) with these options, for a
    /// service started in-process: `--database-url`, `--amqp-url`, retries, prefetch.
    pub fn consumer_flags(&self, database_url: String, amqp_url: String) -> Vec<String> {
        let mut flags = vec![
            "--database-url".to_owned(),
            database_url,
            "--amqp-url".to_owned(),
            amqp_url,
            "--retry-delays".to_owned(),
            self.retry_delays.clone(),
            "--max-attempts".to_owned(),
            self.max_attempts.to_string(),
            "--prefetch".to_owned(),
            self.prefetch.to_string(),
        ];
        for (variable, value) in &self.consumer_env {
            flags.push(format!("--{}", variable.to_lowercase().replace('_', "-")));
            flags.push(value.clone());
        }
        flags
    }

    /// The relay's flags for tests: fast polling and fast retries of returned rows.
    pub fn relay_flags(database_urls: &str, amqp_url: &str) -> Vec<String> {
        let [poll, initial, max] = RELAY_TIMINGS;
        ["--database-url", database_urls, "--amqp-url", amqp_url]
            .into_iter()
            .chain(["--poll-interval", poll, "--retry-initial", initial, "--retry-max", max])
            .map(str::to_owned)
            .collect()
    }
}

/// One service process and its proxies: one to Postgres, and one to RabbitMQ for each node its
/// `AMQP_URL` names.
#[derive(Debug)]
struct Running {
    process: Process,
    database: Proxy,
    brokers: Vec<Proxy>,
}

/// How the services run.
#[derive(Debug)]
enum Run {
    Processes(BTreeMap<Instance, Running>),
    InProcess { trigger: Option<ShutdownTrigger>, tasks: Vec<(Service, JoinHandle<Result<(), BoxError>>)> },
}

/// A running shop. Dropping it kills its processes (or stops its tasks) and removes the test's
/// databases and vhost; process logs stay in [`Shop::log_dir`] if the test failed.
#[derive(Debug)]
pub struct Shop {
    run: Run,
    http: BTreeMap<Instance, String>,
    /// The API's load balancer, when several instances run.
    balancer: Option<Balancer>,
    log_dir: PathBuf,
    /// Direct pools (not through the proxies) for checking the books.
    pub orders: PgPool,
    /// See `orders`.
    pub inventory: PgPool,
    /// See `orders`.
    pub billing: PgPool,
    /// Stock totals before any order.
    pub initial_stock: BTreeMap<String, i64>,
    /// Job ids the API accepted (202), in order.
    pub accepted: Vec<Uuid>,
    /// Keep the logs when dropped (they are kept anyway if a test panics).
    pub keep_logs: bool,
    /// The test's broker and databases.
    pub env: TestEnv,
}

/// `NAME_FILE` for the variables a least-privilege shop gives as files.
fn secret_file_variable(name: &str) -> &'static str {
    match name {
        "DATABASE_URL" => "DATABASE_URL_FILE",
        "MIGRATION_DATABASE_URL" => "MIGRATION_DATABASE_URL_FILE",
        "AMQP_URL" => "AMQP_URL_FILE",
        other => panic!("{other} is not given as a file"),
    }
}

/// The relay's poll interval, first and longest retry wait in tests: fast.
const RELAY_TIMINGS: [&str; 3] = ["200ms", "50ms", "500ms"];

/// Generous: the machine is shared and noisy; a healthy run takes a fraction of it.
pub const WAIT: Duration = Duration::from_secs(60);

impl Shop {
    /// Start every service as a process and wait until each is ready.
    pub async fn start(options: Options) -> Self {
        let env = match &options.postgres {
            Some(postgres) => TestEnv::with_postgres(postgres).await,
            None => TestEnv::new().await,
        };
        let log_dir = std::env::temp_dir().join(format!("shop-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&log_dir).expect("create log directory");
        let accounts = match options.least_privilege {
            true => Some(crate::roles::provision(&env).await),
            false => None,
        };
        let mut services = BTreeMap::new();
        let mut http = BTreeMap::new();
        let instances = Service::ALL
            .into_iter()
            .flat_map(|service| (0..options.instances.max(1)).map(move |index| Instance { service, index }));
        for instance in instances {
            let service = instance.service;
            let database_url = match service {
                Service::Api => env.database_url("orders"),
                Service::Inventory => env.database_url("inventory"),
                Service::Billing => env.database_url("billing"),
                Service::Relay => ["orders", "inventory", "billing"].map(|db| env.database_url(db)).join(","),
            };
            // One proxy carries all of a service's database connections (the relay's three
            // databases live on one server).
            let (database, database_url) = Proxy::for_url(&database_url).await.expect("database proxy");
            // One proxy for each broker node (a cluster's, or the one node named again).
            let nodes = env.amqp_nodes();
            let mut brokers = Vec::new();
            for node in nodes.iter().cycle().take(options.broker_nodes.max(nodes.len())) {
                brokers.push(Proxy::for_url(node).await.expect("broker proxy"));
            }
            let amqp_url = brokers.iter().map(|(_, url)| url.as_str()).collect::<Vec<_>>().join(",");
            let brokers = brokers.into_iter().map(|(proxy, _)| proxy).collect();
            let port = process::free_port();
            let mut vars = match &accounts {
                None => vec![("DATABASE_URL", database_url), ("AMQP_URL", amqp_url)],
                // Secrets as files, the way a deployment keeps them out of the environment.
                Some(accounts) => accounts
                    .service_env(service, &database_url, &amqp_url)
                    .into_iter()
                    .map(|(name, value)| match name {
                        "OUTBOX_RELAY_ROLE" => (name, value),
                        _ => {
                            let file = log_dir.join(format!("{instance}.{name}"));
                            std::fs::write(&file, format!("{value}\n")).expect("write a secret file");
                            (secret_file_variable(name), file.display().to_string())
                        }
                    })
                    .collect(),
            };
            vars.extend([("HTTP_ADDR", format!("127.0.0.1:{port}")), ("RUST_LOG", options.log_filter.clone())]);
            if service == Service::Relay {
                let [poll, initial, max] = RELAY_TIMINGS;
                vars.extend([
                    ("RELAY_POLL_INTERVAL", poll.to_owned()),
                    ("RELAY_RETRY_INITIAL", initial.to_owned()),
                    ("RELAY_RETRY_MAX", max.to_owned()),
                ]);
                vars.extend(options.relay_env.iter().cloned());
            } else {
                vars.extend([
                    ("RETRY_DELAYS", options.retry_delays.clone()),
                    ("MAX_ATTEMPTS", options.max_attempts.to_string()),
                    ("PREFETCH", options.prefetch.to_string()),
                ]);
                vars.extend(options.consumer_env.iter().cloned());
            }
            if service == Service::Api {
                vars.push(("AUTH_JWT_KEY", crate::auth::KEY.to_owned()));
                // The live page's parking depths, of the test's own vhost, and its console of
                // parked messages, as the test's (administrator's) broker user.
                vars.push(("RABBITMQ_MANAGEMENT_URL", env.management_url().to_owned()));
                vars.push(("CONSOLE_AMQP_URL", env.amqp_url()));
                // The books checked as in production, through the read-only role where there is one;
                // by the first API only (each would check the same books, with connections of its
                // own, and the test servers' connection slots are few).
                if instance.index > 0 {
                    vars.push(("BOOKS_CHECK", "off".to_owned()));
                }
                for (name, database) in [("BOOKS_INVENTORY_URL", "inventory"), ("BOOKS_BILLING_URL", "billing")] {
                    let url = env.database_url(database);
                    vars.push((name, accounts.as_ref().map_or(url.clone(), |accounts| accounts.books_url(&url))));
                }
                // Soon after the workers' migrations, which the API's first check may precede.
                vars.push(("BOOKS_INTERVAL", "5s".to_owned()));
            }
            if matches!(service, Service::Inventory | Service::Billing) {
                vars.push(("DEMO_FAULTS", options.demo_faults.to_string()));
                vars.push(("DEMO_CATALOGUE", "true".to_owned()));
            }
            let vars = vars.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            let binary = service_binary(options.bin_dir.as_deref(), service);
            let process = Process::spawn(&instance.to_string(), binary, vars, &log_dir);
            http.insert(instance, format!("http://127.0.0.1:{port}"));
            services.insert(instance, Running { process, database, brokers });
            // Each service migrates its own database; the relay needs those tables to exist.
            if service != Service::Relay {
                wait_ready_at(&http[&instance], &log_dir).await;
            }
        }
        let mut shop = Self::assemble(env, Run::Processes(services), http, log_dir).await;
        for relay in shop.instances().into_iter().filter(|instance| instance.service == Service::Relay) {
            shop.wait_ready(relay).await;
        }
        if options.instances > 1 {
            let apis = shop.http.iter().filter(|(instance, _)| instance.service == Service::Api);
            let upstreams = apis.map(|(_, base)| base.trim_start_matches("http://").to_owned()).collect();
            shop.balancer = Some(Balancer::start(upstreams).await.expect("the APIs' load balancer"));
        }
        // Ready on its port is not enough: a service that could not bind it answers nothing, and
        // whatever else holds the port does.
        shop.assert_all_running();
        if options.bin_dir.is_none() {
            shop.assert_build(options.test_build).await;
        }
        shop
    }

    /// Upgrade a service instance: stop it (SIGTERM, as a deployment does) and start the binary
    /// in `bin_dir` (another release's, see [`Options::bin_dir`]), or else this build's, with the
    /// same settings. Does not wait until it is ready: a relay, say, waits for the migrations of
    /// the services it serves.
    pub async fn upgrade(&mut self, at: impl Into<Instance>, bin_dir: Option<&std::path::Path>) {
        let at = at.into();
        let binary = service_binary(bin_dir, at.service);
        let process = self.process(at);
        process.terminate(WAIT).await;
        process.replace_binary(binary);
        process.start();
    }

    /// Every instance is a test build (`test_build`), or every one a default build.
    async fn assert_build(&self, test_build: bool) {
        let expected = if test_build { "on" } else { "off" };
        for instance in self.instances() {
            let series = format!("build_info{{failpoints=\"{expected}\"");
            assert_eq!(
                self.metric(instance, &series).await,
                1,
                "{instance} is not a {} build: {}",
                if test_build { "test" } else { "default" },
                if test_build {
                    "build the services with the workspace (`cargo build --workspace --bins`), which turns on the \
                     test kit's features"
                } else {
                    "SHOP_BIN_DIR should hold binaries built without features"
                },
            );
        }
    }

    /// A shop whose services the caller started as tasks of this process, stopped by `trigger`:
    /// `http` names each one's base URL. Waits until each is ready.
    pub async fn in_process(
        env: TestEnv,
        http: BTreeMap<Service, String>,
        trigger: ShutdownTrigger,
        tasks: Vec<(Service, JoinHandle<Result<(), BoxError>>)>,
    ) -> Self {
        let log_dir = std::env::temp_dir();
        // The relay last, in `assemble`: it needs the others' tables.
        for (_, base) in http.iter().filter(|(service, _)| **service != Service::Relay) {
            crate::wait_ready(base, WAIT, "").await;
        }
        let http = http.into_iter().map(|(service, base)| (service.into(), base)).collect();
        Self::assemble(env, Run::InProcess { trigger: Some(trigger), tasks }, http, log_dir).await
    }

    async fn assemble(env: TestEnv, run: Run, http: BTreeMap<Instance, String>, log_dir: PathBuf) -> Self {
        wait_ready_at(&http[&Service::Relay.into()], &log_dir).await;
        let orders = env.pool("orders").await;
        let inventory = env.pool("inventory").await;
        let billing = env.pool("billing").await;
        let initial_stock = ledger::stock_totals(&inventory).await;
        Self {
            run,
            http,
            balancer: None,
            log_dir,
            orders,
            inventory,
            billing,
            initial_stock,
            accepted: Vec::new(),
            keep_logs: false,
            env,
        }
    }

    /// Stop every service: SIGTERM to each process, or the shutdown of every task, and wait for
    /// them; panics if one does not stop in time or a task ended with an error.
    pub async fn stop(mut self) {
        match &mut self.run {
            Run::Processes(services) => {
                for running in services.values_mut() {
                    running.process.terminate(WAIT).await;
                }
            }
            Run::InProcess { trigger, tasks } => {
                if let Some(trigger) = trigger.take() {
                    trigger.trigger();
                }
                for (service, task) in tasks.drain(..) {
                    let finished = tokio::time::timeout(WAIT, task).await.expect("service stops in time");
                    if let Err(error) = finished.expect("service task") {
                        panic!("{service:?} ended with an error: {error}");
                    }
                }
            }
        }
    }

    fn processes(&mut self) -> &mut BTreeMap<Instance, Running> {
        match &mut self.run {
            Run::Processes(services) => services,
            Run::InProcess { .. } => panic!("this shop runs in-process: it has no processes or proxies"),
        }
    }

    fn running(&self, at: impl Into<Instance>) -> &Running {
        match &self.run {
            Run::Processes(services) => &services[&at.into()],
            Run::InProcess { .. } => panic!("this shop runs in-process: it has no processes or proxies"),
        }
    }

    /// Set `available` for the SKUs matching the SQL pattern `skus` (before any order), and take
    /// the stock totals again.
    pub async fn restock(&mut self, skus: &str, available: i32) {
        sqlx::query("update stock set available = $1 where sku like $2")
            .bind(available)
            .bind(skus)
            .execute(&self.inventory)
            .await
            .expect("restock");
        self.initial_stock = ledger::stock_totals(&self.inventory).await;
    }

    /// Where the services' logs are.
    pub fn log_dir(&self) -> &std::path::Path {
        &self.log_dir
    }

    /// Every instance of every service, in start order.
    pub fn instances(&self) -> Vec<Instance> {
        self.http.keys().copied().collect()
    }

    /// A service instance's process (a bare [`Service`]: its first).
    pub fn process(&mut self, at: impl Into<Instance>) -> &mut Process {
        &mut self.processes().get_mut(&at.into()).expect("service").process
    }

    /// The proxy between a service instance and Postgres.
    pub fn database_proxy(&self, at: impl Into<Instance>) -> &Proxy {
        &self.running(at).database
    }

    /// The proxy between a service instance and RabbitMQ (its first node's, if it was given
    /// several).
    pub fn broker_proxy(&self, at: impl Into<Instance>) -> &Proxy {
        &self.running(at).brokers[0]
    }

    /// The proxies between a service instance and RabbitMQ, one for each node its `AMQP_URL`
    /// names ([`Options::broker_nodes`]), in that order.
    pub fn broker_proxies(&self, at: impl Into<Instance>) -> &[Proxy] {
        &self.running(at).brokers
    }

    /// A service instance's own HTTP base URL (a bare [`Service`]: its first instance's).
    pub fn http(&self, at: impl Into<Instance>) -> &str {
        &self.http[&at.into()]
    }

    /// Where clients place orders: the APIs' load balancer when several run, else the API.
    pub fn front(&self) -> String {
        match &self.balancer {
            Some(balancer) => format!("http://{}", balancer.addr()),
            None => self.http(Service::Api).to_owned(),
        }
    }

    /// A service instance's `/readyz`: its status and its body (what is failing, the broker nodes,
    /// the blocked connections, the overdue confirms).
    pub async fn readyz(&self, at: impl Into<Instance>) -> std::io::Result<crate::http::Response> {
        crate::http::request("GET", &format!("{}/readyz", self.http(at)), &[], None).await
    }

    /// Wait until a service instance's `/readyz` says ready.
    pub async fn wait_ready(&self, at: impl Into<Instance>) {
        wait_ready_at(self.http(at), &self.log_dir).await;
    }

    /// `kill -9` a service instance.
    pub async fn kill(&mut self, at: impl Into<Instance>) {
        self.process(at).kill().await;
    }

    /// Start a killed service instance again (with extra variables for this run) and wait until
    /// ready.
    pub async fn restart_with(&mut self, at: impl Into<Instance>, extra: &[(&str, &str)]) {
        let at = at.into();
        self.process(at).start_with(extra);
        self.wait_ready(at).await;
    }

    /// Start a killed service instance again and wait until ready.
    pub async fn restart(&mut self, at: impl Into<Instance>) {
        self.restart_with(at, &[]).await;
    }

    /// Start again every service that exited by itself (a crashing handler), as a supervisor
    /// would, without waiting for it to be ready (it may crash again first); returns how many.
    pub async fn restart_exited(&mut self) -> usize {
        let mut exited = Vec::new();
        for (instance, running) in self.processes() {
            if running.process.check_running().is_err() {
                exited.push(*instance);
            }
        }
        for &instance in &exited {
            self.process(instance).take_exit();
            self.process(instance).start();
        }
        exited.len()
    }
}

impl Drop for Shop {
    fn drop(&mut self) {
        if let Run::InProcess { trigger, .. } = &mut self.run {
            // Tasks still running (a test that panicked before `stop`) end with the runtime.
            if let Some(trigger) = trigger.take() {
                trigger.trigger();
            }
            return;
        }
        if self.keep_logs || std::thread::panicking() {
            eprintln!("service logs kept in {}", self.log_dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// `service`'s binary: in another release's directory ([`Options::bin_dir`]), or else this
/// build's ([`process::binary`]).
fn service_binary(bin_dir: Option<&std::path::Path>, service: Service) -> PathBuf {
    let Some(dir) = bin_dir else { return process::binary(service.binary()) };
    let path = dir.join(service.binary());
    assert!(path.is_file(), "{} is missing: build the release first (.ci/releases)", path.display());
    path
}

async fn wait_ready_at(base: &str, log_dir: &std::path::Path) {
    crate::wait_ready(base, WAIT, &format!("(logs in {})", log_dir.display())).await;
}
