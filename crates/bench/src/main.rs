//! `bench`: in ONE run, on the local Postgres and RabbitMQ, measure what the servers can do with
//! our exact work (the limits), what each stage of the shop does (the real release binaries), the
//! seeds' naive relay as a baseline, the relay at scale, and each service's peak memory; print a
//! table, the targets, and a JSON summary. Ratios, not absolute figures, are what carry from one
//! run (or machine) to another.
//!
//! `just bench`, or: `cargo build --release --bins && cargo run --release -p bench`.
//! Runs on private databases and a private vhost of the servers `DATABASE_URL` / `AMQP_URL` name.

mod end_to_end;
mod limits;
mod open_loop;
mod peers;
mod report;
mod stages;

use std::time::Duration;

use clap::Parser;
use end_to_end::EndToEnd;
use lapin::options::QueuePurgeOptions;
use limits::Catalog;
use messaging::topology;
use report::Report;
use shop_demo::DemoFaults;
use sqlx::PgPool;
use stages::{Cpu, Usage, Used, rate_from_timestamps, start, stop, wait_count};
use testkit::TestEnv;

/// What to measure.
#[derive(Debug, Parser)]
#[command(about = "Measure the machine's limits and the shop's stages in one run")]
struct Args {
    /// Concurrency of the API load and of limit (a).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Messages per limit and per drain. Drain rates are timed between the first and the last
    /// batch, so this must span several relay batches (2048 rows by default), or the relay's rate
    /// reads NaN.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Orders per end-to-end phase.
    #[arg(long, default_value_t = 3_000)]
    orders: usize,
    /// Published rows already in the outbox for the scale test.
    #[arg(long, default_value_t = 1_000_000)]
    history: i64,
    /// Rows of the backlog drain.
    #[arg(long, default_value_t = 100_000)]
    backlog: i64,
    /// Skip the scale section (the slowest).
    #[arg(long)]
    skip_scale: bool,
    /// Run only the end-to-end section, without the targets (they need the limits and stages):
    /// to try a service setting with `--service-var` in minutes.
    #[arg(long)]
    end_to_end_only: bool,
    /// Skip the peers (crates/bench/peers: installed on first use, a Python environment and a
    /// release build outside the clone).
    #[arg(long)]
    skip_peers: bool,
    /// The longest a peer's drain is timed: a peer slower than `messages` in this time is timed
    /// on what it published meanwhile.
    #[arg(long, default_value_t = 60)]
    peer_secs: u64,
    /// A variable for the four services of the end-to-end phases other than the baseline (e.g.
    /// `BATCH_SIZE=32` or `RELAY_LINGER=0`), to try settings against the shipped defaults;
    /// repeatable.
    #[arg(long = "service-var", value_name = "NAME=VALUE", value_parser = name_value)]
    service_vars: Vec<(String, String)>,
    /// The shares of M (the highest paced rate sustained) to measure latency at, instead of
    /// 0.25,0.5,0.9. Only with `--end-to-end-only`, which checks no targets.
    #[arg(long, value_delimiter = ',', value_parser = share, requires = "end_to_end_only")]
    loads: Option<Vec<f64>>,
    /// M in orders/s, instead of searching for it (the search takes 5 to 10 minutes): to measure
    /// latency at shares of a known M. Only with `--end-to-end-only`.
    #[arg(long, value_parser = share, requires = "end_to_end_only")]
    capacity: Option<f64>,
    /// How the paced phases' orders arrive.
    #[arg(long, value_enum, default_value_t = open_loop::Arrivals::Poisson)]
    arrivals: open_loop::Arrivals,
    /// Seconds each paced phase offers orders before its measured window.
    #[arg(long, default_value_t = 10)]
    warm_up_secs: u64,
    /// Seconds of each paced phase's measured window. Below 30, a p99 rests on too few of the
    /// slowest orders to compare runs by.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(3..))]
    window_secs: u64,
    /// Also write the JSON summary to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

const WAIT: Duration = Duration::from_secs(600);

/// Print what a limit or a stage cost the whole machine per message (its own process, Postgres
/// and RabbitMQ) and how busy the machine was meanwhile: near 100 %, the rate is what the CPU
/// allows; well below, it is bound by waiting. Returns the CPU seconds per message.
fn report_usage(report: &mut Report, section: &'static str, who: &str, used: &stages::Used, messages: usize) -> Cpu {
    let per_message = used.cpu.per(messages as f64);
    let busy = format!("machine {:.0} % busy", used.busy * 100.0);
    report.figure(section, &format!("  its CPU per message: {who}"), per_message.total() * 1e6, "us/msg", &busy);
    per_message
}

fn name_value(s: &str) -> Result<(String, String), String> {
    let (name, value) = s.split_once('=').ok_or_else(|| format!("`{s}` is not NAME=VALUE"))?;
    Ok((name.to_owned(), value.to_owned()))
}

/// A share of M, or a rate: a finite number above 0.
fn share(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(share) if share.is_finite() && share > 0.0 => Ok(share),
        _ => Err(format!("`{s}` is not a number above 0, such as 0.25")),
    }
}
/// SKUs of the wide catalog.
const WIDE_CATALOG: usize = 1_000;

/// One run's servers, databases and settings, shared by its sections.
struct Bench {
    args: Args,
    report: Report,
    env: TestEnv,
    log_dir: std::path::PathBuf,
    orders_url: String,
    inventory_url: String,
    orders: PgPool,
    inventory: PgPool,
    amqp: lapin::Connection,
    channel: lapin::Channel,
    /// The inventory worker's endpoint, declared as the worker declares it.
    worker: topology::Endpoint,
    /// The worker's default prefetch and batch size.
    prefetch: u16,
    batch: usize,
    /// The first and last id of the outbox rows the relay's drain publishes and the peers' tables
    /// are filled from: set by [`Bench::limits`].
    relay_rows: Option<(i64, i64)>,
}

/// What the limits section measured, in messages (or commits) per second.
struct Limits {
    a: f64,
    smallest: f64,
    d: f64,
    /// The relay's floor: CPU per row of a pipelined publish (b), a row's claim and its mark, each
    /// measured alone.
    relay_floor: Cpu,
    /// The order's floor.
    order_floor: Floor,
}

/// The smallest work an order needs, each part measured alone by the limits: CPU seconds per
/// order, by part.
struct Floor {
    parts: Vec<(&'static str, Cpu)>,
}

impl Floor {
    fn total(&self) -> Cpu {
        self.parts.iter().fold(Cpu::default(), |sum, (_, part)| sum + *part)
    }
}

/// What a peer drained, at one of its settings.
struct PeerDrain {
    peer: String,
    /// `defaults` or `tuned` ([`peers::SETTINGS`]).
    setting: &'static str,
    /// Rows per second.
    rate: f64,
    /// CPU seconds per message: the peer's, Postgres's and RabbitMQ's.
    cpu_per_message: f64,
    /// Our relay's drain of the same rows just before, rows per second.
    relay_rate: f64,
    /// Its CPU seconds per message: the relay's, Postgres's and RabbitMQ's.
    relay_cpu_per_message: f64,
}

/// What the stages section measured.
struct Stages {
    relay_rate: f64,
    /// The relay drain's CPU seconds per message (relay, Postgres, RabbitMQ).
    relay_cpu_per_message: Cpu,
    worker_rate: f64,
    naive: f64,
    /// With group commit (`ORDER_GROUP_COMMIT`), which decision 0009's targets are for.
    grouped_accept_rate: f64,
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    // Without both, the test kit would start containers of its own (Postgres 17, RabbitMQ 4.3 in
    // Docker), and the run would measure those, not the servers it is compared with.
    for names in [["DATABASE_URL", "TEST_DATABASE_URL"], ["AMQP_URL", "TEST_AMQP_URL"]] {
        if !names.iter().any(|name| std::env::var(name).is_ok_and(|value| !value.is_empty())) {
            eprintln!(
                "bench: {} is not set: name the servers to measure (`just bench` names the local ones, \
                 postgres://postgres@127.0.0.1:5432 and amqp://guest:guest@127.0.0.1:5672)",
                names[0]
            );
            std::process::exit(2);
        }
    }
    let json_path = args.json.clone();
    let skip_scale = args.skip_scale;
    let mut bench = Bench::new(args).await;
    if bench.args.end_to_end_only {
        bench.end_to_end().await;
        bench.finish(json_path);
        return;
    }
    let limits = bench.limits().await;
    let stages = bench.stages().await;
    let peers = if bench.args.skip_peers { Vec::new() } else { bench.peers().await };
    if !skip_scale {
        bench.scale().await;
    }
    let end_to_end = bench.end_to_end().await;
    bench.floors(&limits, &stages, &end_to_end);
    bench.targets(&limits, &stages, &end_to_end, &peers);
    bench.finish(json_path);
}

/// Which broker the run measures: its version, its nodes (`AMQP_URL` names each node of a
/// cluster) and the members of `queue`'s Raft group, which a quorum queue replicates every
/// message to (one on a single node; on a cluster, as many as it was declared with). Asked of the
/// management API for up to 10 s, in case it has not listed the new queue's members yet.
async fn describe_broker(report: &mut Report, env: &TestEnv, queue: &str) {
    let version = env.broker_version().await;
    let url = testkit::http::join(env.management_url(), &format!("/api/queues/{}/{queue}", env.vhost()));
    let mut members = None;
    for _ in 0..20 {
        if let Ok(response) = testkit::http::request("GET", &url, &[], None).await
            && response.status == 200
            && let Some(listed) = response.json()["members"].as_array()
        {
            members = Some(listed.len());
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let nodes = env.amqp_nodes().len() as f64;
    let Some(members) = members else {
        let note = format!("RabbitMQ {version}; the management API did not list the quorum queue's members");
        report.figure("broker", "RabbitMQ nodes named by AMQP_URL", nodes, "", &note);
        return;
    };
    let note = format!("RabbitMQ {version}; the inventory worker's quorum queue has {members} members");
    report.figure("broker", "RabbitMQ nodes named by AMQP_URL", nodes, "", &note);
    report.figure("broker", "members of each quorum queue", members as f64, "", "its messages are replicated to each");
}

/// The logs in `dir` with a line at level WARN or ERROR, and how many such lines each has: all but
/// those a stopping service writes as its sessions close, between "shutdown signal received" and
/// its next start, when a session logs that it is ready. (A log holds every phase's run of its
/// service.)
fn troubled_logs(dir: &std::path::Path) -> Vec<(String, usize)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut troubled: Vec<(String, usize)> = entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let text = std::fs::read_to_string(entry.path()).ok()?;
            let mut stopping = false;
            let lines = text
                .lines()
                .filter(|line| {
                    if line.contains("shutdown signal received") {
                        stopping = true;
                    } else if line.contains("health: ready") {
                        stopping = false;
                    }
                    !stopping && (line.contains(" WARN ") || line.contains(" ERROR "))
                })
                .count();
            (lines > 0).then(|| (entry.file_name().to_string_lossy().into_owned(), lines))
        })
        .collect();
    troubled.sort();
    troubled
}

impl Bench {
    /// Print the report, write its JSON to `json_path` if given, and remove the services' logs,
    /// unless one holds a warning or an error: those are kept, and named.
    fn finish(&self, json_path: Option<std::path::PathBuf>) {
        self.report.print();
        let json = self.report.json();
        println!("\n{json}");
        if let Some(path) = json_path {
            std::fs::write(path, serde_json::to_string_pretty(&json).expect("json")).expect("write json");
        }
        let troubled = troubled_logs(&self.log_dir);
        if troubled.is_empty() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
            return;
        }
        println!("bench: logs with warnings or errors, kept in {}:", self.log_dir.display());
        for (log, lines) in troubled {
            println!("bench:   {log}: {lines} lines");
        }
    }

    /// Private databases (orders and inventory migrated, the hot SKUs restocked) and the worker's
    /// queue on a private vhost.
    async fn new(args: Args) -> Self {
        let env = TestEnv::new().await;
        let log_dir = std::env::temp_dir().join(format!("bench-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&log_dir).expect("log dir");
        println!("bench: {args:?}\nbench: service logs in {}", log_dir.display());

        let orders_url = env.database_url("orders");
        let inventory_url = env.database_url("inventory");
        let orders = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
        let inventory = env.migrated_pool("inventory", &inventory_worker::MIGRATOR).await;
        let mut conn = inventory.acquire().await.expect("connection");
        shop_demo::stock_catalogue(&mut conn).await.expect("the demo's stock");
        drop(conn);
        sqlx::query("update stock set available = 1000000000 where sku like 'SKU-_'")
            .execute(&inventory)
            .await
            .expect("restock");
        let amqp = env.amqp().await;
        let channel = amqp.create_channel().await.expect("channel");
        topology::declare_exchanges(&channel, &[shop::exchanges::ORDERS]).await.expect("exchanges");
        // The worker's queue exactly as the worker declares it, with its default settings.
        let inventory_worker = inventory_worker::worker();
        let defaults = inventory_worker.try_parse_from(["inventory-worker"]).expect("defaults").common.consumer;
        let worker = inventory_worker.endpoint;
        topology::declare_endpoint(&amqp, &worker, &defaults.retry_policy()).await.expect("endpoint");
        let mut report = Report::default();
        describe_broker(&mut report, &env, worker.name).await;
        Self {
            args,
            report,
            env,
            log_dir,
            orders_url,
            inventory_url,
            orders,
            inventory,
            amqp,
            channel,
            worker,
            prefetch: defaults.prefetch,
            batch: usize::from(defaults.batch_size),
            relay_rows: None,
        }
    }

    /// Empty the worker's queue.
    async fn purge(&self) {
        self.channel.queue_purge(self.worker.name.into(), QueuePurgeOptions::default()).await.expect("purge");
    }

    /// A service's variables, on database `url` (for the relay, its outbox databases,
    /// comma-separated). The workers write the demo's catalogue, which the orders are made of.
    fn service_vars(&self, url: &str) -> Vec<(&'static str, String)> {
        vec![
            ("DATABASE_URL", url.to_owned()),
            ("AMQP_URL", self.env.amqp_url()),
            ("DEMO_CATALOGUE", "true".to_owned()),
            // The orders API checks the bench's bearer tokens (`open_loop::operator`) against it.
            ("AUTH_JWT_KEY", testkit::auth::KEY.to_owned()),
        ]
    }

    /// The servers with our exact work, no service code; and from them the relay's floor and the
    /// order's.
    async fn limits(&mut self) -> Limits {
        let (n, c, report) = (self.args.messages, self.args.concurrency, &mut self.report);
        let who = "the bench, Postgres, RabbitMQ";
        println!("\n== limits: the servers with our exact work, no service code ==");
        let a = limits::order_transaction(&self.orders_url, c, n).await;
        report.figure("limit", "(a) order transaction commits", a, "/s", &format!("concurrency {c}"));
        let smallest_pool = self.env.messaging_pool("smallest").await;
        let window = Usage::of_bench();
        let smallest = limits::smallest_order_transaction(&smallest_pool, c, n).await;
        let smallest_used = window.finish();
        smallest_pool.close().await;
        let note = format!("order + lines as JSON, outbox row; concurrency {c}");
        report.figure("limit", "(a') smallest order transaction commits", smallest, "/s", &note);
        let order_cpu = report_usage(report, "limit", who, &smallest_used, n);
        let rows = limits::outbox_rows(&self.orders, n).await;
        // The same rows fill each peer's table, and our relay drains them again beside each peer.
        peers::write_rows(&rows, &self.peer_rows());
        self.relay_rows = rows.iter().map(|row| row.id).min().zip(rows.iter().map(|row| row.id).max());
        // The broker's rate swings most from run to run on this shared machine: the median of three.
        // Its CPU is the three runs' alone: the purges between them are not a publish's work.
        let (mut b_runs, mut b_used) = (Vec::new(), Used::default());
        for _ in 0..3 {
            let window = Usage::of_bench();
            b_runs.push(limits::publish(&self.amqp, &rows, 256).await);
            let used = window.finish();
            b_used.cpu = b_used.cpu + used.cpu;
            b_used.busy += used.busy / 3.0;
            if b_runs.len() < 3 {
                self.purge().await;
            }
        }
        b_runs.sort_by(f64::total_cmp);
        let b = b_runs[1];
        let runs = b_runs.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ");
        let note = format!("window 256, quorum queue; median of {runs}");
        let report = &mut self.report;
        report.figure("limit", "(b) publish with pipelined confirms", b, "/s", &note);
        let publish_cpu = report_usage(report, "limit", who, &b_used, 3 * n);
        // The rest of the relay's floor: its claim and its mark of a row, each alone, in the
        // batches of the relay the stages start (its RELAY_BATCH_SIZE, as this environment sets it
        // or by default).
        let relay = relay::Config::try_parse_from(["relay"]).expect("the relay's defaults").relay;
        let batch = usize::try_from(relay.batch_size).expect("a positive batch size");
        // On a session as the relay opens it (decision 0028: its claim walks the index).
        let options: sqlx::postgres::PgConnectOptions =
            self.env.database_url("orders").parse().expect("the orders database's URL");
        let sessions = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(relay::session_options(options, &messaging::runtime::db::DbTimeouts::default()))
            .await
            .expect("connect as the relay does");
        let (claim, mark) = limits::claim_and_mark(&sessions, &rows, batch).await;
        sessions.close().await;
        let (claim_cpu, mark_cpu) = (claim.cpu.per(n as f64), mark.cpu.per(n as f64));
        let note = format!("{batch} rows a transaction, rolled back");
        report.figure("limit", "(b') the relay's claim of a row, CPU", claim_cpu.total() * 1e6, "us/row", &note);
        let note = format!("{batch} rows a statement, committed");
        report.figure("limit", "(b'') the relay's mark of a row, CPU", mark_cpu.total() * 1e6, "us/row", &note);
        let relay_floor = publish_cpu + claim_cpu + mark_cpu;
        let label = "the relay's floor: (b) + (b') + (b''), CPU";
        report.figure("limit", label, relay_floor.total() * 1e6, "us/row", "");
        let window = Usage::of_bench();
        let c_rate = limits::consume(&self.amqp, self.worker.name, n, self.prefetch).await;
        let c_used = window.finish();
        report.figure("limit", "(c) consume + ack", c_rate, "/s", &format!("prefetch {}", self.prefetch));
        let consume_cpu = report_usage(report, "limit", who, &c_used, n);
        let (d, inventory_cpu, billing_cpu, status_cpu) = self.consumer_limits().await;
        let order_floor = Floor {
            parts: vec![
                ("(a') the smallest order transaction", order_cpu),
                ("3 x the relay's floor: the three messages relayed", relay_floor * 3.0),
                ("4 x (c): inventory, billing, status consumer twice", consume_cpu * 4.0),
                ("(d) inventory's transactions, per message", inventory_cpu),
                ("(e) billing's transactions, per message", billing_cpu),
                ("2 x (f): status consumer's, per message", status_cpu * 2.0),
            ],
        };
        Limits { a, smallest, d, relay_floor, order_floor }
    }

    /// (d), (e), (f): each consumer's transactions on fresh messages, in the consumers' shape
    /// (BATCH_SIZE and PREFETCH as this environment sets them or by default), each service's own
    /// handler on a database of its own tables: (d)'s rate, and each one's CPU per message.
    async fn consumer_limits(&mut self) -> (f64, Cpu, Cpu, Cpu) {
        let (n, size) = (self.args.messages, u32::from(self.prefetch) + 1);
        let shape = self.shape();
        let inventory = limits::pool(&self.inventory_url, size).await;
        let handler = inventory_worker::handler(DemoFaults::default());
        let label = "(d) inventory transactions, messages";
        let (d, inventory_cpu) =
            self.consumer_limit(label, &shape, &inventory, self.worker.name, handler, limits::orders_placed(n)).await;
        // (d)'s rows are not part of any later stage.
        sqlx::query("truncate inbox, outbox").execute(&inventory).await.expect("retire (d) rows");
        inventory.close().await;

        let billing = self.limit_pool("limit_billing", &billing_worker::MIGRATOR, size).await;
        let mut conn = billing.acquire().await.expect("connection");
        shop_demo::price_catalogue(&mut conn).await.expect("the demo's prices");
        drop(conn);
        let (endpoint, handler) =
            (billing_worker::worker().endpoint.name, billing_worker::handler(DemoFaults::default()));
        let label = "(e) billing transactions, messages";
        let messages = limits::inventory_reserved(n);
        let (_, billing_cpu) = self.consumer_limit(label, &shape, &billing, endpoint, handler, messages).await;
        billing.close().await;

        // The status consumer moves jobs and orders the API accepted: half as many orders, each
        // reserved and then invoiced.
        let orders = self.limit_pool("limit_orders", &orders_api::MIGRATOR, size).await;
        let messages = limits::order_outcomes(&orders, n / 2).await;
        let (endpoint, handler) =
            (orders_api::status::endpoint().name, orders_api::status::handler(Default::default()));
        let (label, note) = (
            "(f) status consumer transactions, messages",
            format!("{shape}; inventory.reserved, then invoice.created, of {} orders", n / 2),
        );
        let (_, status_cpu) = self.consumer_limit(label, &note, &orders, endpoint, handler, messages).await;
        orders.close().await;
        (d, inventory_cpu, billing_cpu, status_cpu)
    }

    /// A pool of `size` connections on this run's database `name`, migrated with `migrator`.
    async fn limit_pool(&self, name: &str, migrator: &sqlx::migrate::Migrator, size: u32) -> PgPool {
        self.env.migrated_pool(name, migrator).await.close().await;
        limits::pool(&self.env.database_url(name), size).await
    }

    /// One consumer's limit: [`limits::consumer_transactions`] on `messages`, reported as `label`;
    /// its rate and CPU per message.
    async fn consumer_limit<H: messaging::handler::Handler>(
        &mut self,
        label: &str,
        note: &str,
        pool: &PgPool,
        endpoint: &'static str,
        handler: H,
        messages: Vec<messaging::envelope::Incoming>,
    ) -> (f64, Cpu) {
        let (count, prefetch) = (messages.len(), usize::from(self.prefetch));
        let (rate, used) = limits::consumer_transactions(pool, endpoint, handler, messages, prefetch, self.batch).await;
        self.report.figure("limit", label, rate, "/s", note);
        (rate, report_usage(&mut self.report, "limit", "the bench, Postgres, RabbitMQ", &used, count))
    }

    /// How the worker takes its messages: in batches, or concurrently.
    fn shape(&self) -> String {
        if self.batch > 1 {
            format!("{} per transaction, one at a time", self.batch)
        } else {
            format!("concurrency {}", self.prefetch)
        }
    }

    /// Each stage alone, with the release binaries: the relay's and the worker's drains, the naive
    /// relay, the API's accept rate.
    async fn stages(&mut self) -> Stages {
        let n = self.args.messages;
        println!("\n== stages: the release binaries ==");
        // Relay: drain (a)'s N order.placed rows.
        let (relay_rate, relay_used) = self.drain_outbox("true").await;
        self.report.figure("stage", "relay drain (pre-filled outbox)", relay_rate, "/s", &format!("{n} rows"));
        let relay_cpu_per_message =
            report_usage(&mut self.report, "stage", "relay, Postgres, RabbitMQ", &relay_used, n);

        // Inventory worker: drain the N order.placed the relay just queued.
        let worker_vars = self.service_vars(&self.inventory_url);
        let (inventory_worker, _) = start("inventory-worker", &worker_vars, &self.log_dir).await;
        let window = stages::Usage::start(&inventory_worker.pid().into_iter().collect::<Vec<_>>());
        wait_count(&self.inventory, "select count(*) from inbox", n as i64, WAIT).await;
        let drain_used = window.finish();
        stop(inventory_worker).await;
        let worker_rate = rate_from_timestamps(&self.inventory, "inbox", "received_at", "true").await;
        let note = format!("{n} messages, prefetch {}, batch {}", self.prefetch, self.batch);
        self.report.figure("stage", "inventory-worker drain (pre-queued order.placed)", worker_rate, "/s", &note);
        // The drain applies one batch at a time, so it may be bound by its round trips rather than
        // by CPU: its machine's busy share tells.
        report_usage(&mut self.report, "stage", "worker, Postgres, RabbitMQ", &drain_used, n);
        stages::retire_unpublished(&self.inventory).await;

        // Baseline: the naive relay on the same pre-filled outbox.
        sqlx::query("update outbox set published_at = null").execute(&self.orders).await.expect("reset outbox");
        let naive = stages::naive_relay(&self.orders, &self.amqp, n, Duration::from_secs(20)).await;
        let label = "naive relay (one row: publish, confirm, mark, commit)";
        self.report.figure("baseline", label, naive, "/s", "same outbox");
        stages::retire_unpublished(&self.orders).await;
        self.purge().await;

        // API accept rate.
        let c = self.args.concurrency;
        let (api, api_addr) = start("orders-api", &self.service_vars(&self.orders_url), &self.log_dir).await;
        let (accept_rate, _) = stages::post_orders(&api_addr, c, n, Catalog::Hot).await;
        let note = format!("concurrency {c}, keep-alive; each order a transaction of its own");
        self.report.figure("stage", "API accept (POST -> 202)", accept_rate, "/s", &note);
        stop(api).await;
        stages::retire_unpublished(&self.orders).await;
        // What group commit buys (opt-in, decision 0009): the same orders, those that arrive
        // together written in one statement.
        let mut vars = self.service_vars(&self.orders_url);
        vars.push(("ORDER_GROUP_COMMIT", "true".to_owned()));
        let (api, api_addr) = start("orders-api", &vars, &self.log_dir).await;
        let (grouped_rate, _) = stages::post_orders(&api_addr, c, n, Catalog::Hot).await;
        let note = format!("{:.2} x each order alone", grouped_rate / accept_rate);
        self.report.figure("stage", "API accept with ORDER_GROUP_COMMIT", grouped_rate, "/s", &note);
        stop(api).await;
        stages::retire_unpublished(&self.orders).await;
        Stages { relay_rate, relay_cpu_per_message, worker_rate, naive, grouped_accept_rate: grouped_rate }
    }

    /// Where [`Bench::limits`] writes the rows the peers fill their tables from.
    fn peer_rows(&self) -> std::path::PathBuf {
        self.log_dir.join("peer-rows.jsonl")
    }

    /// Each peer at its defaults and tuned, on its own database filled from the same rows as our
    /// relay's drain, into a quorum queue of its own: its drain rate and CPU per message. Our relay
    /// drains the same rows again just before each peer's run, so each ratio compares two drains
    /// of one moment, not a peer with a figure from an earlier section. Returns what each drained,
    /// for the targets.
    async fn peers(&mut self) -> Vec<PeerDrain> {
        println!("\n== peers: published outbox relays on the same rows, each beside our relay ==");
        let peers = match peers::install() {
            Ok(peers) => peers,
            Err(error) => {
                println!("  peers not measured: {error}");
                return Vec::new();
            }
        };
        let limit = Duration::from_secs(self.args.peer_secs);
        let mut rates = Vec::new();
        for peer in &peers {
            for setting in peers::SETTINGS {
                let database = format!("peer_{}_{setting}", peer.name.replace('-', "_"));
                self.env.pool(&database).await.close().await;
                let database_url = self.env.database_url(&database);
                peer.fill(&database_url, &self.peer_rows()).await;
                let (relay_rate, relay_cpu) = self.relay_again().await;
                let queue = format!("peer.{}.{setting}", peer.name);
                let log = self.log_dir.join(format!("{}-{setting}.log", peer.name));
                let (amqp_url, n) = (self.env.amqp_url(), self.args.messages);
                let run = peers::Run {
                    database_url: &database_url,
                    amqp_url: &amqp_url,
                    queue: &queue,
                    setting,
                    rows: n,
                    limit,
                    log,
                };
                let drain = peer.drain(&self.channel, run).await;
                let label = format!("{}, {setting}: drain", peer.label());
                let note = if drain.complete {
                    format!("{n} rows")
                } else {
                    format!("{} of {n} rows in {:.0} s", drain.published, drain.seconds)
                };
                self.report.figure("peers", &label, drain.rate, "/s", &note);
                let who = format!("{}, Postgres, RabbitMQ", peer.name);
                let per_message = report_usage(&mut self.report, "peers", &who, &drain.used, drain.published as usize);
                let note = format!("{n} rows, just before; {}", relay_cpu.split("relay"));
                self.report.figure("peers", "  our relay's drain beside it", relay_rate, "/s", &note);
                self.report.figure("peers", "  our relay's drain / this", relay_rate / drain.rate, "x", "");
                let cpu = per_message.total() / relay_cpu.total();
                self.report.figure("peers", "  this CPU per message / our relay's", cpu, "x", "");
                self.channel
                    .queue_delete(queue.as_str().into(), Default::default())
                    .await
                    .expect("delete the peer's queue");
                rates.push(PeerDrain {
                    peer: peer.name.clone(),
                    setting,
                    rate: drain.rate,
                    cpu_per_message: per_message.total(),
                    relay_rate,
                    relay_cpu_per_message: relay_cpu.total(),
                });
            }
        }
        rates
    }

    /// Our relay draining the rows of its stage drain again (marked unpublished), as in
    /// [`Bench::stages`]: its rate and CPU seconds per message (relay, Postgres, RabbitMQ).
    async fn relay_again(&mut self) -> (f64, Cpu) {
        let (first, last) = self.relay_rows.expect("the limits chose the relay's rows");
        let rows = sqlx::query("update outbox set published_at = null where id between $1 and $2")
            .bind(first)
            .bind(last)
            .execute(&self.orders)
            .await
            .expect("the rows unpublished again")
            .rows_affected();
        let (rate, used) = self.drain_outbox(&format!("id between {first} and {last}")).await;
        self.purge().await;
        (rate, used.cpu.per(rows as f64))
    }

    /// The relay with an empty outbox, with published history, and with a backlog.
    async fn scale(&mut self) {
        println!("\n== scale: the relay with history and with a backlog ==");
        let n = self.args.messages;
        let orders = &self.orders;
        let template: i64 = sqlx::query_scalar("select min(id) from outbox").fetch_one(orders).await.expect("template");
        sqlx::query("delete from outbox where id <> $1").bind(template).execute(orders).await.expect("empty outbox");
        sqlx::query("vacuum analyze outbox").execute(orders).await.expect("vacuum");
        let empty = self.relay_drain("empty table", template, n as i64).await;
        self.report.figure("scale", "relay drain, outbox otherwise empty", empty, "/s", &format!("{n} rows"));
        self.purge().await;
        stages::fill_outbox(&self.orders, template, self.args.history, true).await;
        sqlx::query("vacuum analyze outbox").execute(&self.orders).await.expect("vacuum");
        let with_history = self.relay_drain("history", template, n as i64).await;
        let label = format!("relay drain, {} published rows present", self.args.history);
        self.report.figure("scale", &label, with_history, "/s", &format!("{n} rows"));
        self.purge().await;
        let started = std::time::Instant::now();
        let backlog = self.relay_drain("backlog", template, self.args.backlog).await;
        let label = format!("relay drain of a {}-row backlog", self.args.backlog);
        let note = format!("all published in {:.1} s", started.elapsed().as_secs_f64());
        self.report.figure("scale", &label, backlog, "/s", &note);
        self.purge().await;
        self.report.at_least("relay drain with history / empty >= 0.8", with_history / empty, 0.8);
    }

    /// Add `rows` copies of row `template` to the outbox, and time a relay draining them.
    async fn relay_drain(&self, label: &str, template: i64, rows: i64) -> f64 {
        let orders = &self.orders;
        let first: i64 =
            sqlx::query_scalar("select coalesce(max(id), 0) from outbox").fetch_one(orders).await.expect("max id");
        stages::fill_outbox(orders, template, rows, false).await;
        let (rate, _) = self.drain_outbox(&format!("id > {first}")).await;
        println!("  ({label})");
        rate
    }

    /// Start a relay on the orders outbox, wait until it holds no unpublished row, stop it: the
    /// rate at which it published the rows `filter` selects ([`rate_from_timestamps`]), and what it,
    /// Postgres and RabbitMQ used meanwhile.
    async fn drain_outbox(&self, filter: &str) -> (f64, Used) {
        let (relay, _) = start("relay", &self.service_vars(&self.orders_url), &self.log_dir).await;
        let window = stages::Usage::start(&relay.pid().into_iter().collect::<Vec<_>>());
        wait_count(&self.orders, "select count(*) from outbox where published_at is null and not scheduled", 0, WAIT)
            .await;
        let used = window.finish();
        stop(relay).await;
        (rate_from_timestamps(&self.orders, "outbox", "published_at", filter).await, used)
    }

    /// What an order and a relayed row cost against their floors, as a whole and side by side: the
    /// services' (or the relay's) own CPU against the floor's client code, and each server's.
    fn floors(&mut self, limits: &Limits, stages: &Stages, end_to_end: &EndToEnd) {
        println!("\n== floors: the cost of an order and of a relayed row ==");
        let report = &mut self.report;
        let split = |cpu: &Cpu| cpu.split("own");
        for (part, cpu) in &limits.order_floor.parts {
            report.figure("floor", part, cpu.total() * 1e6, "us/ord", &split(cpu));
        }
        let floor = limits.order_floor.total();
        report.figure("floor", "the order's floor: all of the above", floor.total() * 1e6, "us/ord", &split(&floor));
        let (ours, baseline) = (end_to_end.cpu, end_to_end.cpu_unbatched);
        report.figure("floor", "an order end to end (defaults, hot)", ours.total() * 1e6, "us/ord", &split(&ours));
        let label = "an order end to end, one message per transaction";
        report.figure("floor", label, baseline.total() * 1e6, "us/ord", &split(&baseline));
        let sides = |report: &mut Report, what: &str, cost: &Cpu, floor: &Cpu| {
            let parts = [
                ("own code / the floor's client", cost.own / floor.own),
                ("postgres / the floor's", cost.postgres / floor.postgres),
                ("rabbitmq / the floor's", cost.rabbitmq / floor.rabbitmq),
            ];
            for (part, ratio) in parts {
                report.figure("floor", &format!("  {what}: {part}"), ratio, "x", "");
            }
        };
        report.figure("floor", "end to end / the floor", ours.total() / floor.total(), "x", "CPU per order");
        sides(report, "end to end", &ours, &floor);
        report.figure("floor", "one message per transaction / the floor", baseline.total() / floor.total(), "x", "");
        report.figure("floor", "end to end / one message per transaction", ours.total() / baseline.total(), "x", "");
        let (relay, relay_floor) = (stages.relay_cpu_per_message, limits.relay_floor);
        report.figure("floor", "a row the relay drains", relay.total() * 1e6, "us/row", &split(&relay));
        report.figure("floor", "the relay's floor", relay_floor.total() * 1e6, "us/row", &split(&relay_floor));
        report.figure("floor", "relay / its floor", relay.total() / relay_floor.total(), "x", "CPU per row");
        sides(report, "relay", &relay, &relay_floor);
    }

    /// The targets, against this run's own figures.
    fn targets(&mut self, limits: &Limits, stages: &Stages, end_to_end: &EndToEnd, peers: &[PeerDrain]) {
        let report = &mut self.report;
        // At its defaults a peer shows its configuration more than its design: only the tuned
        // runs have targets.
        for drain in peers.iter().filter(|drain| drain.setting != "defaults") {
            let peer = &drain.peer;
            report.at_least(format!("relay drain / {peer} tuned >= 3"), drain.relay_rate / drain.rate, 3.0);
            let cpu = drain.relay_cpu_per_message / drain.cpu_per_message;
            report.at_most(format!("relay CPU per message / {peer} tuned's <= 0.5"), cpu, 0.5);
        }
        let (c2p50, c2p99) = end_to_end.commit_to_publish;
        let order_cost = end_to_end.cpu.total() / limits.order_floor.total().total();
        report.below("end-to-end CPU per order / its floor < 1.25", order_cost, 1.25);
        // Decision 0009's targets, met by group commit, which a deployment turns on for them.
        let grouped = stages.grouped_accept_rate;
        report.at_least("API accept, group commit / smallest order transaction >= 0.7", grouped / limits.smallest, 0.7);
        report.at_least("API accept, group commit / (a) >= 0.7", grouped / limits.a, 0.7);
        let relay_cost = stages.relay_cpu_per_message.total() / limits.relay_floor.total();
        report.below("relay CPU per row / its floor (b + b' + b'') < 1.25", relay_cost, 1.25);
        report.at_least("relay drain / naive relay >= 10", stages.relay_rate / stages.naive, 10.0);
        report.at_least("inventory drain / (d) >= 0.7", stages.worker_rate / limits.d, 0.7);
        report.below("commit -> publish p50 ms < 5", c2p50, 5.0);
        report.below("commit -> publish p99 ms < 10", c2p99, 10.0);
        report.below("peak RSS MiB, largest service < 64", end_to_end.peak_rss, 64.0);
        // Without M there is no latency at its shares either: each of those targets is missed too.
        let Some(capacity) = end_to_end.capacity else {
            report.at_least("M / D >= 0.75 (M not found)", 0.0, 0.75);
            report.below("POST -> succeeded p99 ms at 50 % of M < 150 (M not found)", f64::NAN, 150.0);
            report.below("POST -> succeeded p99 ms at 90 % of M < 400 (M not found)", f64::NAN, 400.0);
            report.at_most("CPU per order at 25 % of M / the drain's <= 2.5 (M not found)", f64::NAN, 2.5);
            report.at_most("CPU per order at 50 % of M / the drain's <= 1.6 (M not found)", f64::NAN, 1.6);
            return;
        };
        report.at_least("M / D >= 0.75", capacity / end_to_end.drain, 0.75);
        for at in &end_to_end.at_shares {
            let share = format!("{:.0} % of M", at.share * 100.0);
            let p99 = match at.share {
                0.5 => Some(150.0),
                0.9 => Some(400.0),
                _ => None,
            };
            if let Some(bound) = p99 {
                report.below(format!("POST -> succeeded p99 ms at {share} < {bound}"), at.latency.p99, bound);
            }
            let cpu = match at.share {
                0.25 => Some(2.5),
                0.5 => Some(1.6),
                _ => None,
            };
            if let Some(bound) = cpu {
                let name = format!("CPU per order at {share} / the drain's <= {bound}");
                report.at_most(name, at.cpu / end_to_end.cpu.total(), bound);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Args, troubled_logs};
    use clap::Parser;

    #[test]
    fn loads_and_a_given_capacity_are_numbers_above_zero_and_only_for_an_end_to_end_run() {
        let args = Args::try_parse_from(["bench", "--end-to-end-only", "--loads", "0.1,0.15"]).expect("loads");
        assert_eq!(args.loads, Some(vec![0.1, 0.15]));
        assert_eq!(Args::try_parse_from(["bench"]).expect("defaults").loads, None);
        // A full run checks the latency targets at 50 and 90 %: it keeps them.
        assert!(Args::try_parse_from(["bench", "--loads", "0.1"]).is_err());
        // `--loads=…`, so that clap hands "-0.5" to the parser instead of reading it as a flag.
        for bad in ["0", "-0.5", "half", "0.25,", "NaN", "inf"] {
            let arg = format!("--loads={bad}");
            assert!(Args::try_parse_from(["bench", "--end-to-end-only", &arg]).is_err(), "{bad}");
            let arg = format!("--capacity={bad}");
            assert!(Args::try_parse_from(["bench", "--end-to-end-only", &arg]).is_err(), "{bad}");
        }
        let args = Args::try_parse_from(["bench", "--end-to-end-only", "--capacity", "420"]).expect("capacity");
        assert_eq!(args.capacity, Some(420.0));
        // A full run searches for M: the targets compare it with D.
        assert!(Args::try_parse_from(["bench", "--capacity", "420"]).is_err());
    }

    #[test]
    fn a_log_is_troubled_by_what_its_service_writes_while_it_runs_not_by_its_stop() {
        let dir = std::env::temp_dir().join(format!("bench-logs-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let stopped = "\
            2026-12-03T08:28:12Z  INFO messaging::runtime::health: ready what=\"relay\"\n\
            2026-12-03T08:28:13Z  INFO messaging::runtime::shutdown: shutdown signal received\n\
            2026-12-03T08:28:13Z  WARN relay: messaging::runtime::health: not ready what=\"relay\"\n";
        std::fs::write(dir.join("quiet.log"), stopped).expect("write");
        // Its second run, in the same log: a warning once it is ready again counts, and an error
        // before its first stop too.
        let troubled = format!(
            "2026-12-03T08:28:10Z ERROR relay: the broker refused\n{stopped}\
             2026-12-03T08:29:00Z  INFO messaging::runtime::health: ready what=\"relay\"\n\
             2026-12-03T08:29:01Z  WARN sqlx::query: slow statement\n{stopped}"
        );
        std::fs::write(dir.join("relay.log"), troubled).expect("write");

        assert_eq!(troubled_logs(&dir), [("relay.log".to_owned(), 2)]);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
