//! `bench`: in ONE run, on the local Postgres and RabbitMQ, measure what the servers can do with
//! our exact work (the limits), what each stage of the shop does (the real release binaries), the
//! seeds' naive relay as a baseline, the relay at scale, and each service's peak memory; print a
//! table, the targets, and a JSON summary. Ratios, not absolute figures, are what carry from one
//! run (or machine) to another.
//!
//! `just bench`, or: `cargo build --release --bins && cargo run --release -p bench`.
//! Runs on private databases and a private vhost of the servers `DATABASE_URL` / `AMQP_URL` name.

mod limits;
mod report;
mod stages;

use std::time::Duration;

use clap::Parser;
use lapin::options::QueuePurgeOptions;
use limits::Catalog;
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
    /// A variable for the four services of the end-to-end phases other than the baseline (e.g.
    /// `BATCH_SIZE=32` or `RELAY_LINGER=0`), to try settings against the shipped defaults;
    /// repeatable.
    #[arg(long = "service-var", value_name = "NAME=VALUE", value_parser = name_value)]
    service_vars: Vec<(String, String)>,
    /// Also write the JSON summary to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

const WAIT: Duration = Duration::from_secs(600);

/// Print what a limit or a stage cost the whole machine per message (its own process, Postgres
/// and RabbitMQ) and how busy the machine was meanwhile: near 100 %, the rate is what the CPU
/// allows; well below, it is bound by waiting. Returns the CPU seconds per message.
fn report_usage(report: &mut Report, section: &'static str, who: &str, used: &stages::Used, messages: usize) -> f64 {
    let per_message = used.cpu_seconds / messages as f64;
    let busy = format!("machine {:.0} % busy", used.busy * 100.0);
    report.figure(section, &format!("  its CPU per message: {who}"), per_message * 1e6, "us/msg", &busy);
    per_message
}

/// What an end-to-end phase cost.
struct PhaseCost {
    /// CPU milliseconds per order, by service process, then Postgres and RabbitMQ.
    cpu_per_order: Vec<(String, f64)>,
    /// Transactions committed in the three databases, per order.
    commits: f64,
    /// The machine's busy share over the phase (0 to 1).
    busy: f64,
}

impl PhaseCost {
    /// Print it under `label`; returns the whole CPU per order, in seconds.
    fn report(&self, report: &mut Report, label: &str) -> f64 {
        for (name, milliseconds) in &self.cpu_per_order {
            report.figure("cpu", &format!("{label}: {name}"), milliseconds * 1000.0, "us/ord", "CPU time per order");
        }
        let note = "transactions committed in the three databases, per order";
        report.figure("cpu", &format!("{label}: commits"), self.commits, "/ord", note);
        let note = "share of the machine's CPU time in use over the phase";
        report.figure("cpu", &format!("{label}: machine busy"), self.busy * 100.0, "%", note);
        let total: f64 = self.cpu_per_order.iter().map(|(_, milliseconds)| milliseconds).sum();
        report.figure("cpu", &format!("{label}: all of the above"), total * 1000.0, "us/ord", "");
        total / 1000.0
    }
}

/// The database name at the end of a Postgres URL.
fn db_name(url: &str) -> String {
    url.rsplit('/').next().unwrap_or_default().to_owned()
}

/// `vars` and then `extra`.
fn env_with<'a>(vars: &'a [(&'a str, String)], extra: &'a [(String, String)]) -> Vec<(&'a str, String)> {
    vars.iter().cloned().chain(extra.iter().map(|(name, value)| (name.as_str(), value.clone()))).collect()
}

fn name_value(s: &str) -> Result<(String, String), String> {
    let (name, value) = s.split_once('=').ok_or_else(|| format!("`{s}` is not NAME=VALUE"))?;
    Ok((name.to_owned(), value.to_owned()))
}
/// SKUs of the wide catalog.
const WIDE_CATALOG: usize = 1_000;

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
    let smallest_pool = env.messaging_pool("smallest").await;
    let smallest = limits::smallest_order_transaction(&smallest_pool, c, n).await;
    smallest_pool.close().await;
    report.figure(
        "limit",
        "(a') smallest order transaction commits",
        smallest,
        "/s",
        &format!("order + lines as JSON, outbox row; concurrency {c}"),
    );
    let rows = limits::outbox_rows(&orders, n).await;
    // The broker's rate swings most from run to run on this shared machine: the median of three.
    let mut b_runs = Vec::new();
    let window = stages::Usage::start(&[std::process::id()]);
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
    report_usage(&mut report, "limit", "the bench, Postgres, RabbitMQ", &window.finish(), 3 * n);
    let c_rate = limits::consume(&amqp, worker.name, n, prefetch).await;
    report.figure("limit", "(c) consume + ack", c_rate, "/s", &format!("prefetch {prefetch}"));
    // The worker's own shape: batches of BATCH_SIZE one at a time, or (BATCH_SIZE=1) single
    // messages PREFETCH at once.
    let batch = usize::from(defaults.batch_size);
    let window = stages::Usage::start(&[std::process::id()]);
    let d = limits::worker_transaction(&inventory_url, usize::from(prefetch), batch, n).await;
    let d_used = window.finish();
    let shape =
        if batch > 1 { format!("{batch} per transaction, one at a time") } else { format!("concurrency {prefetch}") };
    report.figure("limit", "(d) inventory transactions, messages", d, "/s", &shape);
    report_usage(&mut report, "limit", "the bench, Postgres, RabbitMQ", &d_used, n);
    // (d)'s rows are not part of any later stage.
    sqlx::query("truncate inbox, outbox").execute(&inventory).await.expect("retire (d) rows");

    println!("\n== stages: the release binaries ==");
    let relay_vars = |database: &str| vec![("DATABASE_URL", database.to_owned()), ("AMQP_URL", env.amqp_url())];
    // Relay: drain (a)'s N order.placed rows.
    let (relay, _) = start("relay", &relay_vars(&orders_url), &log_dir).await;
    let window = stages::Usage::start(&relay.pid().into_iter().collect::<Vec<_>>());
    wait_count(&orders, "select count(*) from outbox where published_at is null", 0, WAIT).await;
    let relay_used = window.finish();
    stop(relay).await;
    let relay_rate = rate_from_timestamps(&orders, "outbox", "published_at", "true").await;
    report.figure("stage", "relay drain (pre-filled outbox)", relay_rate, "/s", &format!("{n} rows"));
    report_usage(&mut report, "stage", "relay, Postgres, RabbitMQ", &relay_used, n);

    // Inventory worker: drain the N order.placed the relay just queued.
    let worker_vars = vec![("DATABASE_URL", inventory_url.clone()), ("AMQP_URL", env.amqp_url())];
    let (inventory_worker, _) = start("inventory-worker", &worker_vars, &log_dir).await;
    let window = stages::Usage::start(&inventory_worker.pid().into_iter().collect::<Vec<_>>());
    wait_count(&inventory, "select count(*) from inbox", n as i64, WAIT).await;
    let drain_used = window.finish();
    stop(inventory_worker).await;
    let worker_rate = rate_from_timestamps(&inventory, "inbox", "received_at", "true").await;
    report.figure(
        "stage",
        "inventory-worker drain (pre-queued order.placed)",
        worker_rate,
        "/s",
        &format!("{n} messages, prefetch {prefetch}, batch {batch}"),
    );
    // The drain applies one batch at a time, so it may be bound by its round trips rather than by
    // CPU: its machine's busy share tells.
    let drain_cpu_per_message = report_usage(&mut report, "stage", "worker, Postgres, RabbitMQ", &drain_used, n);
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
    let (accept_rate, _) = stages::post_orders(&api_addr, c, n, Catalog::Hot).await;
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
    let billing_vars = vec![("DATABASE_URL", billing_url.clone()), ("AMQP_URL", env.amqp_url())];
    let all = format!("{orders_url},{inventory_url},{billing_url}");
    let wide = Catalog::Wide(WIDE_CATALOG);
    sqlx::query(
        "insert into stock (sku, available) select unnest($1::text[]), 1000000000 on conflict (sku) do nothing",
    )
    .bind(Catalog::wide_skus(WIDE_CATALOG))
    .execute(&inventory)
    .await
    .expect("wide catalog");
    let slowest = accept_rate.min(relay_rate).min(worker_rate);
    let databases: Vec<String> =
        ["orders", "inventory", "billing"].iter().map(|service| db_name(&env.database_url(service))).collect();
    // The shop with `extra` variables on its four services.
    let start_shop = |extra: Vec<(String, String)>| {
        let (api_vars, worker_vars, billing_vars) = (api_vars.clone(), worker_vars.clone(), billing_vars.clone());
        let (relay_vars, log_dir) = (relay_vars(&all), &log_dir);
        async move {
            let (api, api_addr) = start("orders-api", &env_with(&api_vars, &extra), log_dir).await;
            let (inventory_worker, _) = start("inventory-worker", &env_with(&worker_vars, &extra), log_dir).await;
            let (billing_worker, _) = start("billing-worker", &env_with(&billing_vars, &extra), log_dir).await;
            let (relay, _) = start("relay", &env_with(&relay_vars, &extra), log_dir).await;
            (api_addr, [api, inventory_worker, billing_worker, relay])
        }
    };
    // Sustained maximum: offer as fast as the API answers, until every order has succeeded; with
    // each process's and each server's CPU seconds per order over the phase.
    let sustained = |label: &'static str, api_addr: String, catalog: Catalog, pids: Vec<(String, u32)>| {
        let (orders, databases) = (&orders, &databases);
        let report_note = format!("{} orders, concurrency {c}, {label}", args.orders);
        async move {
            let cpu = |pids: &[(String, u32)]| {
                let mut seconds: Vec<(String, f64)> =
                    pids.iter().map(|(name, pid)| (name.clone(), stages::cpu_seconds(*pid))).collect();
                seconds.push(("postgres (all)".into(), stages::cpu_seconds_of("postgres")));
                seconds.push(("rabbitmq (all)".into(), stages::cpu_seconds_of("beam.smp")));
                seconds
            };
            let before = cpu(&pids);
            let commits_before = stages::commits(orders, databases).await;
            // After `commits`, which waits for the statistics to settle.
            let machine = stages::Busy::start();
            let (_, jobs) = stages::post_orders(&api_addr, c, args.orders, catalog).await;
            stages::wait_succeeded(orders, &jobs).await;
            let busy = machine.finish();
            let after = cpu(&pids);
            let commits = stages::commits(orders, databases).await - commits_before;
            let (rate,): (f64,) = sqlx::query_as(
                "select count(*) / extract(epoch from max(updated_at) - min(created_at))::float8 from jobs where id = any($1)",
            )
            .bind(&jobs)
            .fetch_one(orders)
            .await
            .expect("sustained");
            let cpu_per_order = before
                .iter()
                .zip(after)
                .map(|((name, was), (_, is))| (name.clone(), (is - was) * 1000.0 / jobs.len() as f64))
                .collect();
            let cost = PhaseCost { cpu_per_order, commits: commits as f64 / jobs.len() as f64, busy };
            (rate, cost, report_note)
        }
    };
    let pids = |processes: &[testkit::process::Process; 4]| -> Vec<(String, u32)> {
        processes.iter().filter_map(|p| Some((p.name().to_owned(), p.pid()?))).collect()
    };
    // The same-run baseline: every consumer as before batching, one message per transaction,
    // 16 at once (BATCH_SIZE=1 and the PREFETCH that was measured best for it).
    let before_batching = [("BATCH_SIZE", "1"), ("PREFETCH", "16")];
    let (api_addr, processes) =
        start_shop(before_batching.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect())
            .await;
    let (unbatched, cpu_unbatched, note) =
        sustained("BATCH_SIZE=1, PREFETCH=16", api_addr, Catalog::Hot, pids(&processes)).await;
    report.figure("e2e", "sustained, one message per transaction (baseline)", unbatched, "/s", &note);
    cpu_unbatched.report(&mut report, "BATCH_SIZE=1");
    for process in processes {
        stop(process).await;
    }

    // The shipped defaults (or what --service-var sets), four hot SKUs, then a wide catalog.
    let (api_addr, processes) = start_shop(args.service_vars.clone()).await;
    let (hot, cpu_hot, note) =
        sustained("defaults, 4 hot SKUs", api_addr.clone(), Catalog::Hot, pids(&processes)).await;
    report.figure("e2e", "sustained throughput (POST -> succeeded)", hot, "/s", &note);
    let cpu_per_order = cpu_hot.report(&mut report, "defaults, hot");
    // The wide catalog's prices (its stock was created above), in the database billing created.
    let billing = env.pool("billing").await;
    sqlx::query(
        "insert into prices (sku, unit_price_cents) select unnest($1::text[]), 100 on conflict (sku) do nothing",
    )
    .bind(Catalog::wide_skus(WIDE_CATALOG))
    .execute(&billing)
    .await
    .expect("wide catalog prices");
    let label = "defaults, wide catalog";
    let (wide_rate, cpu_wide, note) = sustained(label, api_addr.clone(), wide, pids(&processes)).await;
    report.figure("e2e", &format!("sustained throughput, {WIDE_CATALOG} SKUs"), wide_rate, "/s", &note);
    cpu_wide.report(&mut report, "defaults, wide");
    report.figure("e2e", "sustained / slowest stage alone", hot / slowest, "x", &format!("slowest {slowest:.0}/s"));
    // If both used the whole machine, that ratio would be the inventory drain's CPU per message
    // over an order's: the inventory's share of what an order costs.
    report.figure(
        "e2e",
        "  the same if both used the whole machine",
        drain_cpu_per_message / cpu_per_order,
        "x",
        "inventory drain's CPU per message / an order's CPU (hot)",
    );
    report.figure("e2e", "sustained / baseline (BATCH_SIZE=1, PREFETCH=16)", hot / unbatched, "x", "same run");

    // Latency at half of it.
    let offered = hot / 2.0;
    let sent = stages::post_orders_at(&api_addr, c, args.orders, offered).await;
    let sent_ids: Vec<uuid::Uuid> = sent.iter().map(|(id, _)| *id).collect();
    stages::wait_succeeded(&orders, &sent_ids).await;
    let mut steps = stages::latency_steps(&orders, &inventory, &billing, &sent).await;
    let (_, latencies) = steps.pop().expect("the last step is succeeded");
    let (p50, p95, p99) = percentiles(&latencies);
    let note = format!("offered {offered:.0}/s");
    report.figure("e2e", "POST -> succeeded p50", p50, "ms", &note);
    report.figure("e2e", "POST -> succeeded p95", p95, "ms", &note);
    report.figure("e2e", "POST -> succeeded p99", p99, "ms", &note);
    // Where that time goes: p50 and p99 from the send to each step before it.
    for (step, latencies) in steps {
        let (p50, _, p99) = percentiles(&latencies);
        report.figure("e2e", &format!("  to {step}, p50"), p50, "ms", "");
        report.figure("e2e", &format!("  to {step}, p99"), p99, "ms", "");
    }

    // Commit -> publish with the relay idle on NOTIFY.
    let pings = stages::commit_to_publish(&orders, &amqp, 300, Duration::from_millis(10)).await;
    let (c2p50, _, c2p99) = percentiles(&pings);
    report.figure("e2e", "commit -> publish p50 (relay idle on NOTIFY)", c2p50, "ms", "300 rows, 10 ms apart");
    report.figure("e2e", "commit -> publish p99", c2p99, "ms", "");

    let mut peak = 0.0_f64;
    for process in &processes {
        let rss = process.peak_rss_kib().unwrap_or(0) as f64 / 1024.0;
        peak = peak.max(rss);
        report.figure("memory", &format!("peak RSS {}", process.name()), rss, "MiB", "after the end-to-end load");
    }
    for process in processes {
        stop(process).await;
    }

    report.at_least("end to end / slowest stage alone >= 0.5", hot / slowest, 0.5);
    report.at_least("API accept / smallest order transaction >= 0.7", accept_rate / smallest, 0.7);
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
