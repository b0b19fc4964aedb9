//! The shop started in-process ([`testkit::shop::Shop::in_process`]): every service as a task of
//! the test, on its own random port, with the harness's options. The suites that need processes
//! to die use [`Shop::start`] instead; both give the same [`Shop`].

#![allow(dead_code, missing_docs)]

use std::collections::BTreeMap;

use clap::Parser;
use messaging::{
    handler::Handler,
    runtime::shutdown::{self, Shutdown},
    service::{BoxError, Worker},
};
use shop_demo::Demo;
use sqlx::PgPool;
use testkit::{
    TestEnv,
    shop::{Options, Service},
};
use tokio::{net::TcpListener, task::JoinHandle};

pub use testkit::shop::Shop;

async fn listener() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    (listener, url)
}

/// Start the shop in this process with default options.
pub async fn start() -> Shop {
    start_with(Options::default()).await
}

/// Start the shop in this process.
pub async fn start_with(options: Options) -> Shop {
    let env = TestEnv::new().await;
    let (trigger, stop) = shutdown::channel();
    let amqp = env.amqp_url();
    let flags = |binary: &str, database: &str| {
        let mut args = vec![binary.to_owned()];
        args.extend(options.consumer_flags(env.database_url(database), amqp.clone()));
        args
    };
    let mut http = BTreeMap::new();
    let mut tasks = Vec::new();

    let (l, url) = listener().await;
    let mut api = flags("orders-api", "orders");
    api.extend(["--auth-jwt-key".to_owned(), testkit::auth::KEY.to_owned()]);
    for (flag, database) in [("--books-inventory-url", "inventory"), ("--books-billing-url", "billing")] {
        api.extend([flag.to_owned(), env.database_url(database)]);
    }
    let config = orders_api::Config::parse_from(api);
    let run = orders_api::run(config, l, stop.clone());
    tasks.push((Service::Api, tokio::spawn(run)));
    http.insert(Service::Api, url);

    let faults = ["--demo-faults", &options.demo_faults.to_string(), "--demo-catalogue", "true"].map(str::to_owned);
    let inventory = inventory_worker::worker();
    let args = [flags(inventory.name, inventory.database), faults.to_vec()].concat();
    let (url, task) = spawn_worker(inventory, args, stop.clone()).await;
    tasks.push((Service::Inventory, task));
    http.insert(Service::Inventory, url);
    let billing = billing_worker::worker();
    let args = [flags(billing.name, billing.database), faults.to_vec()].concat();
    let (url, task) = spawn_worker(billing, args, stop.clone()).await;
    tasks.push((Service::Billing, task));
    http.insert(Service::Billing, url);

    let (l, url) = listener().await;
    let databases = ["orders", "inventory", "billing"].map(|s| env.database_url(s)).join(",");
    let mut args = vec!["relay".to_owned()];
    args.extend(Options::relay_flags(&databases, &amqp));
    let run = relay::run(relay::Config::parse_from(args), l, stop.clone());
    tasks.push((Service::Relay, tokio::spawn(run)));
    http.insert(Service::Relay, url);

    Shop::in_process(env, http, trigger, tasks).await
}

/// Start a worker built on `messaging::service::Worker` as a task of this process, with `args`;
/// its base URL and its task.
async fn spawn_worker<H: Handler>(
    worker: Worker<Demo, H>,
    args: Vec<String>,
    stop: Shutdown,
) -> (String, JoinHandle<Result<(), BoxError>>) {
    let (listener, url) = listener().await;
    let settings = worker.try_parse_from(args).expect("flags");
    let run = worker.run(settings, listener, stop);
    (url, tokio::spawn(async move { run.await.map_err(BoxError::from) }))
}

/// The one number `sql`, a test's own statement, selects.
pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).fetch_one(pool).await.expect(sql)
}
