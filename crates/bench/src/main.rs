//! `bench`: in ONE run, on the local Postgres and RabbitMQ, measure what the servers can do with
//! our exact work (the limits), what each stage of the shop does (the real release binaries), the
//! seeds' naive relay as a baseline, the relay at scale, and each service's peak memory; print a
//! table, the targets, and a JSON summary. Ratios, not absolute figures, are what carry from one
//! run (or machine) to another.
//!
//! `just bench`, or: `cargo build --release --bins && cargo run --release -p bench`.
//! Runs on private databases and a private vhost of the servers `DATABASE_URL` / `AMQP_URL` name.

mod http1;
mod limits;
mod report;
mod stages;

use std::time::Duration;

use clap::Parser;
use lapin::options::QueuePurgeOptions;
use messaging::topology;
use report::Report;
use stages::{percentiles, rate_from_timestamps, start, stop, wait_count};
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
    /// Also write the JSON summary to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

const WAIT: Duration = Duration::from_secs(600);

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let mut report = Report::default();
    let env = TestEnv::new().await;
    let log_dir = std::env::temp_dir().join(format!("bench-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&log_dir).expect("log dir");
    println!("bench: {args:?}\nbench: service logs in {}", log_dir.display());

    let orders_url = env.database_url("orders");
    let inventory_url = env.database_url("inventory");
    let orders = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    let inventory = env.migrated_pool("inventory", &inventory_worker::MIGRATOR).await;
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
    let prefetch = defaults.prefetch;
    let worker = inventory_worker.endpoint;
    topology::declare_endpoint(&channel, &worker, &defaults.retry_policy()).await.expect("endpoint");
    let purge = || async {
        channel.queue_purge(worker.name.into(), QueuePurgeOptions::default()).await.expect("purge");
    };
    let n = args.messages;
    let c = args.concurrency;

    println!("\n== limits: the servers with our exact work, no service code ==");
    let a = limits::order_transaction(&orders_url, c, n).await;
    report.figure("limit", "(a) order transaction commits", a, "/s", &format!("concurrency {c}"));
    let rows = limits::outbox_rows(&orders, n).await;
    // The broker's rate swings most from run to run on this shared machine: the median of three.
    let mut b_runs = Vec::new();
    for _ in 0..3 {
        b_runs.push(limits::publish(&amqp, &rows, 256).await);
        if b_runs.len() < 3 {
            purge().await;
        }
    }
    b_runs.sort_by(f64::total_cmp);
    let b = b_runs[1];
    let runs = b_runs.iter().map(|r| format!("{r:.0}")).collect::<Vec<_>>().join(", ");
    report.figure(
        "limit",
        "(b) publish with pipelined confirms",
        b,
        "/s",
        &format!("window 256, quorum queue; median of {runs}"),
    );
    let c_rate = limits::consume(&amqp, worker.name, n, prefetch).await;
    report.figure("limit", "(c) consume + ack", c_rate, "/s", &format!("prefetch {prefetch}"));
    let d = limits::worker_transaction(&inventory_url, prefetch.into(), u32::from(prefetch) + 1, n).await;
    report.figure("limit", "(d) inventory transaction commits", d, "/s", &format!("concurrency {prefetch}"));
    // (d)'s rows are not part of any later stage.
    sqlx::query("truncate inbox, outbox").execute(&inventory).await.expect("retire (d) rows");

    println!("\n== stages: the release binaries ==");
    let relay_vars = |database: &str| vec![("DATABASE_URL", database.to_owned()), ("AMQP_URL", env.amqp_url())];
    // Relay: drain (a)'s N order.placed rows.
    let (relay, _) = start("relay", &relay_vars(&orders_url), &log_dir).await;
    wait_count(&orders, "select count(*) from outbox where published_at is null", 0, WAIT).await;
    stop(relay).await;
    let relay_rate = rate_from_timestamps(&orders, "outbox", "published_at", "true").await;
    report.figure("stage", "relay drain (pre-filled outbox)", relay_rate, "/s", &format!("{n} rows"));

    // Inventory worker: drain the N order.placed the relay just queued.
    let worker_vars = vec![("DATABASE_URL", inventory_url.clone()), ("AMQP_URL", env.amqp_url())];
    let (inventory_worker, _) = start("inventory-worker", &worker_vars, &log_dir).await;
    wait_count(&inventory, "select count(*) from inbox", n as i64, WAIT).await;
    stop(inventory_worker).await;
    let worker_rate = rate_from_timestamps(&inventory, "inbox", "received_at", "true").await;
    report.figure(
        "stage",
        "inventory-worker drain (pre-queued order.placed)",
        worker_rate,
        "/s",
        &format!("{n} messages, prefetch {prefetch}"),
    );
    stages::retire_unpublished(&inventory).await;

    // Baseline: the naive relay on the same pre-filled outbox.
    sqlx::query("update outbox set published_at = null").execute(&orders).await.expect("reset outbox");
    let naive = stages::naive_relay(&orders, &amqp, n, Duration::from_secs(20)).await;
    report.figure("baseline", "naive relay (one row: publish, confirm, mark, commit)", naive, "/s", "same outbox");
    stages::retire_unpublished(&orders).await;
    purge().await;

    // API accept rate.
    let api_vars = vec![("DATABASE_URL", orders_url.clone()), ("AMQP_URL", env.amqp_url())];
    let (api, api_addr) = start("orders-api", &api_vars, &log_dir).await;
    let (accept_rate, _) = stages::post_orders(&api_addr, c, n).await;
    report.figure("stage", "API accept (POST -> 202)", accept_rate, "/s", &format!("concurrency {c}, keep-alive"));
    stop(api).await;
    stages::retire_unpublished(&orders).await;

    if !args.skip_scale {
        println!("\n== scale: the relay with history and with a backlog ==");
        let template: i64 =
            sqlx::query_scalar("select min(id) from outbox").fetch_one(&orders).await.expect("template");
        let drain = |label: &'static str, rows: i64| {
            let (orders, log_dir, vars) = (&orders, &log_dir, relay_vars(&orders_url));
            async move {
                let first: i64 = sqlx::query_scalar("select coalesce(max(id), 0) from outbox")
                    .fetch_one(orders)
                    .await
                    .expect("max id");
                stages::fill_outbox(orders, template, rows, false).await;
                let (relay, _) = start("relay", &vars, log_dir).await;
                wait_count(orders, "select count(*) from outbox where published_at is null", 0, WAIT).await;
                stop(relay).await;
                let rate = rate_from_timestamps(orders, "outbox", "published_at", &format!("id > {first}")).await;
                println!("  ({label})");
                rate
            }
        };
        sqlx::query("delete from outbox where id <> $1").bind(template).execute(&orders).await.expect("empty outbox");
        sqlx::query("vacuum analyze outbox").execute(&orders).await.expect("vacuum");
        let empty = drain("empty table", n as i64).await;
        report.figure("scale", "relay drain, outbox otherwise empty", empty, "/s", &format!("{n} rows"));
        purge().await;
        stages::fill_outbox(&orders, template, args.history, true).await;
        sqlx::query("vacuum analyze outbox").execute(&orders).await.expect("vacuum");
        let with_history = drain("history", n as i64).await;
        report.figure(
            "scale",
            &format!("relay drain, {} published rows present", args.history),
            with_history,
            "/s",
            &format!("{n} rows"),
        );
        purge().await;
        let started = std::time::Instant::now();
        let backlog = drain("backlog", args.backlog).await;
        report.figure(
            "scale",
            &format!("relay drain of a {}-row backlog", args.backlog),
            backlog,
            "/s",
            &format!("all published in {:.1} s", started.elapsed().as_secs_f64()),
        );
        purge().await;
        report.at_least("relay drain with history / empty >= 0.8", with_history / empty, 0.8);
    }

    println!("\n== end to end: every service ==");
    let billing_url = env.database_url("billing");
    let (api, api_addr) = start("orders-api", &api_vars, &log_dir).await;
    let (inventory_worker, _) = start("inventory-worker", &worker_vars, &log_dir).await;
    let billing_vars = vec![("DATABASE_URL", billing_url.clone()), ("AMQP_URL", env.amqp_url())];
    let (billing_worker, _) = start("billing-worker", &billing_vars, &log_dir).await;
    let all = format!("{orders_url},{inventory_url},{billing_url}");
    let (relay, _) = start("relay", &relay_vars(&all), &log_dir).await;

    // Sustained maximum: offer as fast as the API answers, until every order has succeeded.
    let (_, jobs) = stages::post_orders(&api_addr, c, args.orders).await;
    stages::wait_succeeded(&orders, &jobs).await;
    let (sustained, _): (f64, i64) = sqlx::query_as(
        "select count(*) / extract(epoch from max(updated_at) - min(created_at))::float8, count(*) from jobs where id = any($1)",
    )
    .bind(&jobs)
    .fetch_one(&orders)
    .await
    .expect("sustained");
    report.figure(
        "e2e",
        "sustained throughput (POST -> succeeded)",
        sustained,
        "/s",
        &format!("{} orders, concurrency {c}", args.orders),
    );

    // Latency at half of it.
    let offered = sustained / 2.0;
    let sent = stages::post_orders_at(&api_addr, c, args.orders, offered).await;
    let sent_ids: Vec<uuid::Uuid> = sent.iter().map(|(id, _)| *id).collect();
    stages::wait_succeeded(&orders, &sent_ids).await;
    let latencies = stages::latencies_to_succeeded(&orders, &sent).await;
    let (p50, p95, p99) = percentiles(&latencies);
    let note = format!("offered {offered:.0}/s");
    report.figure("e2e", "POST -> succeeded p50", p50, "ms", &note);
    report.figure("e2e", "POST -> succeeded p95", p95, "ms", &note);
    report.figure("e2e", "POST -> succeeded p99", p99, "ms", &note);

    // Commit -> publish with the relay idle on NOTIFY.
    let pings = stages::commit_to_publish(&orders, &amqp, 300, Duration::from_millis(10)).await;
    let (c2p50, _, c2p99) = percentiles(&pings);
    report.figure("e2e", "commit -> publish p50 (relay idle on NOTIFY)", c2p50, "ms", "300 rows, 10 ms apart");
    report.figure("e2e", "commit -> publish p99", c2p99, "ms", "");

    let mut peak = 0.0_f64;
    for process in [&api, &inventory_worker, &billing_worker, &relay] {
        let rss = process.peak_rss_kib().unwrap_or(0) as f64 / 1024.0;
        peak = peak.max(rss);
        report.figure("memory", &format!("peak RSS {}", process.name()), rss, "MiB", "after the end-to-end load");
    }
    for process in [api, inventory_worker, billing_worker, relay] {
        stop(process).await;
    }

    report.at_least("API accept / (a) >= 0.7", accept_rate / a, 0.7);
    report.at_least("relay drain / (b) >= 0.7", relay_rate / b, 0.7);
    report.at_least("relay drain / naive relay >= 10", relay_rate / naive, 10.0);
    report.at_least("inventory drain / (d) >= 0.7", worker_rate / d, 0.7);
    report.below("commit -> publish p50 ms < 5", c2p50, 5.0);
    report.below("commit -> publish p99 ms < 50", c2p99, 50.0);
    report.below("POST -> succeeded p99 ms at half load < 250", p99, 250.0);
    report.below("peak RSS MiB, largest service < 64", peak, 64.0);

    report.print();
    let json = report.json();
    println!("\n{json}");
    if let Some(path) = args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json).expect("json")).expect("write json");
    }
    let _ = std::fs::remove_dir_all(&log_dir);
}
