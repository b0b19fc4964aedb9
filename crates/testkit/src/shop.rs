//! The whole shop as real processes on a private [`TestEnv`], each service reaching Postgres and
//! RabbitMQ through its own pair of fault [`Proxy`]s. The crash tests and the `chaos` soak drive it.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::{
    TestEnv, eventually, http,
    ledger::{self, Ledger},
    process::{self, Process},
    proxy::Proxy,
};

/// The four services.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Service {
    /// `orders-api` (and its job-status consumer).
    Api,
    /// `inventory-worker`.
    Inventory,
    /// `billing-worker`.
    Billing,
    /// `relay`, for all three outboxes.
    Relay,
}

impl Service {
    /// Every service, in start order (the relay last: it needs the others' tables).
    pub const ALL: [Self; 4] = [Self::Api, Self::Inventory, Self::Billing, Self::Relay];

    /// The binary's name.
    pub fn binary(self) -> &'static str {
        match self {
            Self::Api => "orders-api",
            Self::Inventory => "inventory-worker",
            Self::Billing => "billing-worker",
            Self::Relay => "relay",
        }
    }
}

/// Knobs of a process shop.
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
        }
    }
}

/// One service: its process, its HTTP base URL and its two proxies.
#[derive(Debug)]
struct Running {
    process: Process,
    http: String,
    database: Proxy,
    broker: Proxy,
}

/// A running shop of real processes. Dropping it kills them and removes the test's databases and
/// vhost; its logs stay in [`ProcessShop::log_dir`] if the test failed.
#[derive(Debug)]
pub struct ProcessShop {
    services: BTreeMap<Service, Running>,
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
    env: TestEnv,
}

/// Generous: the machine is shared and noisy; a healthy run takes a fraction of it.
pub const WAIT: Duration = Duration::from_secs(60);

impl ProcessShop {
    /// Start every service and wait until each is ready.
    pub async fn start(options: Options) -> Self {
        let env = TestEnv::new().await;
        let log_dir = std::env::temp_dir().join(format!("shop-{}", Uuid::new_v4().simple()));
        std::fs::create_dir_all(&log_dir).expect("create log directory");
        let mut services = BTreeMap::new();
        for service in Service::ALL {
            let database_url = match service {
                Service::Api => env.database_url("orders"),
                Service::Inventory => env.database_url("inventory"),
                Service::Billing => env.database_url("billing"),
                Service::Relay => ["orders", "inventory", "billing"].map(|db| env.database_url(db)).join(","),
            };
            // One proxy carries all of a service's database connections (the relay's three
            // databases live on one server).
            let (database, database_url) = Proxy::for_url(&database_url).await.expect("database proxy");
            let (broker, amqp_url) = Proxy::for_url(&env.amqp_url()).await.expect("broker proxy");
            let port = process::free_port();
            let mut vars = vec![
                ("DATABASE_URL", database_url),
                ("AMQP_URL", amqp_url),
                ("HTTP_ADDR", format!("127.0.0.1:{port}")),
                ("RUST_LOG", options.log_filter.clone()),
            ];
            if service == Service::Relay {
                vars.extend([
                    ("RELAY_POLL_INTERVAL", "200ms".to_owned()),
                    ("RELAY_RETRY_INITIAL", "50ms".to_owned()),
                    ("RELAY_RETRY_MAX", "500ms".to_owned()),
                ]);
            } else {
                vars.extend([
                    ("RETRY_DELAYS", options.retry_delays.clone()),
                    ("MAX_ATTEMPTS", options.max_attempts.to_string()),
                    ("PREFETCH", options.prefetch.to_string()),
                ]);
                vars.extend(options.consumer_env.iter().cloned());
            }
            if matches!(service, Service::Inventory | Service::Billing) {
                vars.push(("DEMO_FAULTS", options.demo_faults.to_string()));
            }
            let vars = vars.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            let process = Process::spawn(service.binary(), process::binary(service.binary()), vars, &log_dir);
            let running = Running { process, http: format!("http://127.0.0.1:{port}"), database, broker };
            services.insert(service, running);
            // Each service migrates its own database; the relay needs those tables to exist.
            if service != Service::Relay {
                wait_ready_at(&services[&service].http, &log_dir).await;
            }
        }
        wait_ready_at(&services[&Service::Relay].http, &log_dir).await;
        let orders = env.pool("orders").await;
        let inventory = env.pool("inventory").await;
        let billing = env.pool("billing").await;
        let initial_stock = ledger::stock_totals(&inventory).await;
        Self {
            services,
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

    /// Set `available` for the SKUs matching the SQL pattern `skus` (before any order), and take
    /// the stock totals again.
    pub async fn restock(&mut self, skus: &str, available: i32) {
        sqlx::query("update stock set available = $2 where sku like $1")
            .bind(skus)
            .bind(available)
            .execute(&self.inventory)
            .await
            .expect("restock");
        self.initial_stock = ledger::stock_totals(&self.inventory).await;
    }

    /// The test's broker and databases.
    pub fn env(&self) -> &TestEnv {
        &self.env
    }

    /// Where the services' logs are.
    pub fn log_dir(&self) -> &std::path::Path {
        &self.log_dir
    }

    /// A service's process.
    pub fn process(&mut self, service: Service) -> &mut Process {
        &mut self.services.get_mut(&service).expect("service").process
    }

    /// The proxy between a service and Postgres.
    pub fn database_proxy(&self, service: Service) -> &Proxy {
        &self.services[&service].database
    }

    /// The proxy between a service and RabbitMQ.
    pub fn broker_proxy(&self, service: Service) -> &Proxy {
        &self.services[&service].broker
    }

    /// A service's HTTP base URL.
    pub fn http(&self, service: Service) -> &str {
        &self.services[&service].http
    }

    /// Wait until a service's `/readyz` says ready.
    pub async fn wait_ready(&self, service: Service) {
        wait_ready_at(self.http(service), &self.log_dir).await;
    }

    /// `kill -9` a service.
    pub async fn kill(&mut self, service: Service) {
        self.process(service).kill().await;
    }

    /// Start a killed service again (with extra variables for this run) and wait until ready.
    pub async fn restart_with(&mut self, service: Service, extra: &[(&str, &str)]) {
        self.process(service).start_with(extra);
        self.wait_ready(service).await;
    }

    /// Start a killed service again and wait until ready.
    pub async fn restart(&mut self, service: Service) {
        self.restart_with(service, &[]).await;
    }

    /// Start again every service that exited by itself (a crashing handler), as a supervisor
    /// would, without waiting for it to be ready (it may crash again first); returns how many.
    pub async fn restart_exited(&mut self) -> usize {
        let mut exited = Vec::new();
        for (service, running) in &mut self.services {
            if running.process.check_running().is_err() {
                exited.push(*service);
            }
        }
        for &service in &exited {
            self.process(service).take_exit();
            self.process(service).start();
        }
        exited.len()
    }

    /// `GET /jobs/{job_id}`.
    pub async fn job(&self, job_id: Uuid) -> Value {
        let url = format!("{}/jobs/{job_id}", self.http(Service::Api));
        let response = http::request("GET", &url, &[], None).await.expect("GET /jobs/{id}");
        assert_eq!(response.status, 200, "GET /jobs/{job_id}: {}", String::from_utf8_lossy(&response.body));
        response.json()
    }

    /// Panic if any service exited by itself.
    pub fn assert_all_running(&mut self) {
        for (service, running) in &mut self.services {
            if let Err(status) = running.process.check_running() {
                panic!("{service:?} exited by itself with {status}; logs in {}", self.log_dir.display());
            }
        }
    }

    /// `POST /orders`, given up after 10 s (an API must answer, even if only 503). A 202's job
    /// id is recorded as accepted.
    pub async fn post_order(&mut self, lines: &[(&str, i32)]) -> std::io::Result<http::Response> {
        let lines: Vec<Value> = lines.iter().map(|(sku, q)| serde_json::json!({"sku": sku, "quantity": q})).collect();
        let body = serde_json::json!({"customerId": "chaos", "lines": lines}).to_string();
        let url = format!("{}/orders", self.http(Service::Api));
        let response = tokio::time::timeout(Duration::from_secs(10), http::request("POST", &url, &[], Some(&body)))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "POST /orders took over 10 s"))??;
        if response.status == 202 {
            let job_id = response.json()["jobId"].as_str().and_then(|id| id.parse().ok()).expect("202 names a jobId");
            self.accepted.push(job_id);
        }
        Ok(response)
    }

    /// Wait until the API accepts an order again (after an outage), placing it.
    pub async fn wait_until_accepting(&mut self) {
        let since = tokio::time::Instant::now();
        while self.post_order(&[("SKU-2", 1)]).await.map_or(0, |r| r.status) != 202 {
            assert!(since.elapsed() < WAIT, "the API did not accept orders again within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Place an order that must be accepted; returns its job id.
    pub async fn place(&mut self, lines: &[(&str, i32)]) -> Uuid {
        let response = self.post_order(lines).await.expect("POST /orders");
        assert_eq!(response.status, 202, "POST /orders: {}", String::from_utf8_lossy(&response.body));
        *self.accepted.last().expect("accepted job")
    }

    /// Place `count` orders of one to three lines from SKU-1..SKU-3 (ample stock); every tenth
    /// names an unknown SKU and will be rejected. Returns their job ids.
    pub async fn place_burst(&mut self, count: usize) -> Vec<Uuid> {
        let mut placed = Vec::with_capacity(count);
        for i in 0..count {
            let skus = ["SKU-1", "SKU-2", "SKU-3"];
            let mut lines: Vec<(&str, i32)> = (0..=i % 3).map(|l| (skus[(i + l) % 3], 1 + (i % 2) as i32)).collect();
            if i % 10 == 9 {
                lines.push(("NOPE-9", 1));
            }
            placed.push(self.place(&lines).await);
        }
        placed
    }

    /// Wait until `needle` appears in a service's log (at least `times` times in all).
    pub async fn wait_for_log(&self, service: Service, needle: &str, times: usize) {
        let process = &self.services[&service].process;
        let what = format!("{needle:?} in {}", process.log_path().display());
        eventually(&what, WAIT, || async { (process.log_count(needle) >= times).then_some(()) }).await;
    }

    /// A counter's value (summed over its label sets) from a service's `/metrics`; 0 if absent.
    pub async fn metric(&self, service: Service, series: &str) -> u64 {
        let url = format!("{}/metrics", self.http(service));
        let Ok(response) = http::request("GET", &url, &[], None).await else { return 0 };
        let text = String::from_utf8_lossy(&response.body).into_owned();
        text.lines()
            .filter(|line| line.starts_with(series) && line[series.len()..].starts_with([' ', '{']))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// Wait until every accepted order is in a terminal state, then read the books; panics with
    /// the books after `timeout`.
    pub async fn settle(&self, timeout: Duration) -> Ledger {
        self.try_settle(timeout).await.unwrap_or_else(|ledger| {
            panic!("orders did not settle within {timeout:?}:\n{ledger}\nlogs in {}", self.log_dir.display())
        })
    }

    /// [`ProcessShop::settle`], with the unsettled books as the error.
    pub async fn try_settle(&self, timeout: Duration) -> Result<Ledger, Ledger> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let ledger = self.ledger().await;
            if ledger.stuck == 0 && ledger.lost == 0 {
                return Ok(ledger);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ledger);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// For a shop without demo faults: every accepted order settles as succeeded or rejected,
    /// the books are clean, and no service died by itself.
    pub async fn assert_books_balance(&mut self) -> Ledger {
        let ledger = self.settle(WAIT).await;
        let logs = self.log_dir.display();
        assert!(ledger.is_clean(), "{ledger}\nlogs in {logs}");
        assert_eq!(ledger.succeeded + ledger.rejected, ledger.accepted as i64, "{ledger}\nlogs in {logs}");
        self.assert_all_running();
        ledger
    }

    /// The books now.
    pub async fn ledger(&self) -> Ledger {
        Ledger::read(&self.orders, &self.inventory, &self.billing, &self.accepted, &self.initial_stock).await
    }
}

impl Drop for ProcessShop {
    fn drop(&mut self) {
        if self.keep_logs || std::thread::panicking() {
            eprintln!("service logs kept in {}", self.log_dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

async fn wait_ready_at(base: &str, log_dir: &std::path::Path) {
    crate::wait_ready(base, WAIT, &format!("(logs in {})", log_dir.display())).await;
}
