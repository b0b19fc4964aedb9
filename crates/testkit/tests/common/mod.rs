//! The shop, started in-process against a private [`TestEnv`]: every service with its own random
//! port, short retry tiers, and helpers to place orders and wait for their outcome.

#![allow(dead_code, missing_docs)]

use std::time::Duration;

use clap::Parser;
use messaging::shutdown::{self, ShutdownTrigger};
use serde_json::Value;
use sqlx::PgPool;
use testkit::{TestEnv, eventually, http};
use tokio::{net::TcpListener, task::JoinHandle};

/// Generous: the machine is shared and noisy; a healthy run takes a fraction of it.
pub const WAIT: Duration = Duration::from_secs(30);

/// Knobs of a test shop.
#[derive(Debug, Clone)]
pub struct Options {
    pub retry_delays: &'static str,
    pub max_attempts: u32,
    pub demo_faults: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self { retry_delays: "50ms,100ms", max_attempts: 5, demo_faults: false }
    }
}

/// A running shop.
pub struct Shop {
    pub env: TestEnv,
    pub api: String,
    pub inventory_http: String,
    pub billing_http: String,
    pub relay_http: String,
    pub orders: PgPool,
    pub inventory: PgPool,
    pub billing: PgPool,
    trigger: ShutdownTrigger,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
}

async fn listener() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    (listener, url)
}

impl Shop {
    pub async fn start() -> Self {
        Self::start_with(Options::default()).await
    }

    pub async fn start_with(options: Options) -> Self {
        let env = TestEnv::new().await;
        // Migrate first, so tests can query at once and the relay finds its tables.
        let orders = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
        let inventory = env.migrated_pool("inventory", &inventory_worker::MIGRATOR).await;
        let billing = env.migrated_pool("billing", &billing_worker::MIGRATOR).await;
        let (trigger, stop) = shutdown::channel();
        let amqp = env.amqp_url();
        let consumer_flags = |db: String| {
            vec![
                "--database-url".to_owned(),
                db,
                "--amqp-url".to_owned(),
                amqp.clone(),
                "--retry-delays".to_owned(),
                options.retry_delays.to_owned(),
                "--max-attempts".to_owned(),
                options.max_attempts.to_string(),
                "--prefetch".to_owned(),
                "8".to_owned(),
            ]
        };
        let mut tasks = Vec::new();

        let (l, api) = listener().await;
        let config =
            orders_api::Config::parse_from(args("orders-api", consumer_flags(env.database_url("orders")), &[]));
        tasks.push(tokio::spawn(orders_api::run(config, l, stop.clone())));

        let faults = ["--demo-faults".to_owned(), options.demo_faults.to_string()];
        let (l, inventory_http) = listener().await;
        let worker = inventory_worker::worker();
        let settings = worker
            .try_parse_from(args("inventory-worker", consumer_flags(env.database_url("inventory")), &faults))
            .expect("inventory flags");
        let run = worker.run(settings, l, stop.clone());
        tasks.push(tokio::spawn(async move { Ok(run.await?) }));

        let (l, billing_http) = listener().await;
        let worker = billing_worker::worker();
        let settings = worker
            .try_parse_from(args("billing-worker", consumer_flags(env.database_url("billing")), &faults))
            .expect("billing flags");
        let run = worker.run(settings, l, stop.clone());
        tasks.push(tokio::spawn(async move { Ok(run.await?) }));

        let (l, relay_http) = listener().await;
        let databases = ["orders", "inventory", "billing"].map(|s| env.database_url(s)).join(",");
        let config = relay::Config::parse_from(relay_args(&databases, &amqp));
        tasks.push(tokio::spawn(relay::run(config, l, stop.clone())));

        let shop =
            Self { env, api, inventory_http, billing_http, relay_http, orders, inventory, billing, trigger, tasks };
        for base in [&shop.api, &shop.inventory_http, &shop.billing_http, &shop.relay_http] {
            wait_ready(base).await;
        }
        shop
    }

    /// `POST /orders` with a JSON body (and optional extra headers).
    pub async fn post_order(&self, body: &str, headers: &[(&str, &str)]) -> http::Response {
        http::request("POST", &format!("{}/orders", self.api), headers, Some(body)).await.expect("POST /orders")
    }

    /// Place an order and return its job id.
    pub async fn place(&self, lines: &[(&str, i32)]) -> String {
        let lines: Vec<Value> = lines.iter().map(|(sku, q)| serde_json::json!({"sku": sku, "quantity": q})).collect();
        let body = serde_json::json!({"customerId": "c-1", "lines": lines}).to_string();
        let response = self.post_order(&body, &[]).await;
        assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
        response.json()["jobId"].as_str().expect("jobId").to_owned()
    }

    pub async fn job(&self, job_id: &str) -> Value {
        let response = http::request("GET", &format!("{}/jobs/{job_id}", self.api), &[], None).await.expect("GET job");
        assert_eq!(response.status, 200);
        response.json()
    }

    /// Wait until the job reaches `state`, and return it.
    pub async fn wait_for_state(&self, job_id: &str, state: &str) -> Value {
        eventually(&format!("job {job_id} to be {state}"), WAIT, || async {
            let job = self.job(job_id).await;
            (job["state"] == state).then_some(job)
        })
        .await
    }

    /// A counter's value from a service's `/metrics`.
    pub async fn metric(&self, base: &str, series: &str) -> u64 {
        let response = http::request("GET", &format!("{base}/metrics"), &[], None).await.expect("GET /metrics");
        let text = String::from_utf8_lossy(&response.body).into_owned();
        text.lines().find_map(|line| line.strip_prefix(series).and_then(|rest| rest.trim().parse().ok())).unwrap_or(0)
    }

    /// Stop every service and wait for them to finish.
    pub async fn stop(self) {
        self.trigger.trigger();
        for task in self.tasks {
            let finished = tokio::time::timeout(WAIT, task).await.expect("service stops in time");
            finished.expect("service task").expect("service ran without error");
        }
    }
}

pub fn args(binary: &str, mut flags: Vec<String>, extra: &[String]) -> Vec<String> {
    flags.insert(0, binary.to_owned());
    flags.extend_from_slice(extra);
    flags
}

/// Relay flags for tests: fast polling and fast retries of returned rows.
pub fn relay_args(databases: &str, amqp: &str) -> Vec<String> {
    [
        "relay",
        "--database-url",
        databases,
        "--amqp-url",
        amqp,
        "--poll-interval",
        "200ms",
        "--retry-initial",
        "50ms",
        "--retry-max",
        "200ms",
    ]
    .map(str::to_owned)
    .to_vec()
}

pub async fn wait_ready(base: &str) {
    testkit::wait_ready(base, WAIT, "").await;
}

pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}
