//! The soak: N orders at a steady offered rate while random services are `kill -9`ed and
//! restarted and their connections to Postgres and RabbitMQ are cut or stalled; then, once every
//! order has settled, it prints the ledger and exits non-zero if any guarantee broke.
//!
//! `cargo build --bins && cargo run -p testkit --bin chaos -- --orders 5000 --kills 24 --cuts 12`
//! (`just chaos`). It runs against the servers `DATABASE_URL` and `AMQP_URL` name, on private
//! databases and a private vhost, so it can share them with anything else.
//!
//! The client behaves as a client should: every order carries an Idempotency-Key and is retried
//! until it gets an answer, so an API killed after its commit but before its reply costs nothing.

use std::{collections::BTreeMap, process::ExitCode, time::Duration};

use clap::Parser;
use testkit::{
    http,
    shop::{Options, ProcessShop, Service},
};
use tokio::{task::JoinSet, time::Instant};
use uuid::Uuid;

/// What to run.
#[derive(Debug, Parser)]
#[command(about = "Soak the shop under crashes and cut connections, then check its books")]
struct Args {
    /// Orders to place.
    #[arg(long, default_value_t = 5000)]
    orders: usize,
    /// Offered load, orders per second.
    #[arg(long, default_value_t = 50.0)]
    rate: f64,
    /// `kill -9`s (each followed by a restart), spread over the run.
    #[arg(long, default_value_t = 24)]
    kills: usize,
    /// Connection cuts or stalls (1 to 3 s each), spread over the run.
    #[arg(long, default_value_t = 12)]
    cuts: usize,
    /// Seed of the random choices (printed, to replay a run).
    #[arg(long)]
    seed: Option<u64>,
    /// Give up waiting for orders to settle after this many seconds.
    #[arg(long, default_value_t = 300)]
    settle_secs: u64,
}

/// What the client saw.
#[derive(Debug, Default)]
struct Driven {
    accepted: Vec<Uuid>,
    /// Accepted orders naming POISON-1: the only ones that may end quarantined.
    poison: usize,
    /// Answers other than 202 (a bug: every order the soak sends is valid).
    refused: usize,
    /// Orders that never got an answer (the API stayed away for a minute).
    unanswered: usize,
    /// Requests repeated after a 503, a timeout or a refused connection.
    retries: usize,
    /// From the first order sent to the last one answered.
    took: Duration,
}

/// What the chaos did.
#[derive(Debug, Default)]
struct Havoc {
    kills: BTreeMap<&'static str, usize>,
    cuts: usize,
    stalls: usize,
    /// Services that exited without being killed.
    self_exits: Vec<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    fastrand::seed(seed);
    println!("chaos: {} orders at {}/s, {} kills, {} cuts, seed {seed}", args.orders, args.rate, args.kills, args.cuts);

    let options = Options {
        retry_delays: "100ms,500ms,1s".into(),
        max_attempts: 4,
        demo_faults: true,
        log_filter: "warn,messaging::consumer=info".into(),
        ..Options::default()
    };
    let mut shop = ProcessShop::start(options).await;
    // Ample stock for the everyday SKUs; SKU-5 keeps its 10 so that some orders are refused.
    shop.restock("SKU-_", 1_000_000).await;
    shop.restock("SKU-5", 10).await;
    println!("chaos: services up, logs in {}", shop.log_dir().display());

    let started = Instant::now();
    let expected = Duration::from_secs_f64(args.orders as f64 / args.rate);
    let api = shop.http(Service::Api).to_owned();
    let (driven, havoc) =
        tokio::join!(drive(&api, args.orders, args.rate, fastrand::u64(..)), wreak(&mut shop, &args, expected));
    let havoc_ended = started.elapsed();
    for service in Service::ALL {
        if shop.process(service).check_running() == Ok(false) {
            shop.restart(service).await;
        }
    }
    shop.accepted = driven.accepted.clone();
    let ledger = shop.try_settle(Duration::from_secs(args.settle_secs)).await.unwrap_or_else(|unsettled| unsettled);
    let settled_in = started.elapsed();
    let duplicates: usize = [Service::Api, Service::Inventory, Service::Billing]
        .into_iter()
        .map(|service| shop.process(service).log_count("duplicate skipped by the inbox"))
        .sum();

    println!("\n== ledger ==\n{ledger}");
    println!("\n== run ==");
    let placed = driven.took.as_secs_f64();
    println!("orders placed in     {placed:>8.1} s  ({:.1}/s; {} offered)", args.orders as f64 / placed, args.rate);
    println!("faults ended after   {:>8.1} s", havoc_ended.as_secs_f64());
    println!("all settled after    {:>8.1} s", settled_in.as_secs_f64());
    println!("kills                {:>8}  {:?}", havoc.kills.values().sum::<usize>(), havoc.kills);
    println!("cuts / stalls        {:>8}  / {}", havoc.cuts, havoc.stalls);
    println!("client retries       {:>8}", driven.retries);
    println!("duplicates skipped   {:>8}  (by the inboxes, from the logs)", duplicates);
    println!("poison orders        {:>8}  (the only ones allowed to end quarantined)", driven.poison);

    let mut failures = Vec::new();
    if !ledger.is_clean() {
        failures.push("the ledger does not balance".to_owned());
    }
    if ledger.quarantined != driven.poison as i64 {
        failures.push(format!("{} quarantined, but {} poison orders", ledger.quarantined, driven.poison));
    }
    if driven.refused + driven.unanswered > 0 {
        failures.push(format!("{} orders refused, {} unanswered", driven.refused, driven.unanswered));
    }
    if !havoc.self_exits.is_empty() {
        failures.push(format!("services exited by themselves: {:?}", havoc.self_exits));
    }
    if failures.is_empty() {
        println!("\nchaos: PASS");
        ExitCode::SUCCESS
    } else {
        println!("\nchaos: FAIL: {}\nlogs kept in {}", failures.join("; "), shop.log_dir().display());
        shop.keep_logs = true;
        ExitCode::FAILURE
    }
}

/// Offer `orders` at `rate` per second, each in its own task so an outage does not lower the
/// offered load; each retries with its Idempotency-Key until answered.
async fn drive(api: &str, orders: usize, rate: f64, seed: u64) -> Driven {
    let mut rng = fastrand::Rng::with_seed(seed);
    let run = Uuid::new_v4().simple().to_string();
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = JoinSet::new();
    let mut driven = Driven::default();
    let started = Instant::now();
    for i in 0..orders {
        ticks.tick().await;
        let (body, poison) = random_order(&mut rng);
        let key = format!("chaos-{run}-{i}");
        let url = format!("{api}/orders");
        tasks.spawn(async move { (place(&url, &body, &key).await, poison) });
    }
    while let Some(joined) = tasks.join_next().await {
        let ((outcome, retries), poison) = joined.expect("order task");
        driven.retries += retries;
        match outcome {
            Placed::Accepted(job_id) => {
                driven.accepted.push(job_id);
                driven.poison += usize::from(poison);
            }
            Placed::Refused => driven.refused += 1,
            Placed::Unanswered => driven.unanswered += 1,
        }
    }
    driven.took = started.elapsed();
    driven
}

enum Placed {
    Accepted(Uuid),
    Refused,
    Unanswered,
}

async fn place(url: &str, body: &str, key: &str) -> (Placed, usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut retries = 0;
    loop {
        let headers = [("Idempotency-Key", key)];
        let attempt = http::request("POST", url, &headers, Some(body));
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(response)) if response.status == 202 => {
                let job_id = response.json()["jobId"].as_str().and_then(|id| id.parse().ok()).expect("jobId");
                return (Placed::Accepted(job_id), retries);
            }
            Ok(Ok(response)) if response.status < 500 => {
                eprintln!("chaos: {} for {body}: {}", response.status, String::from_utf8_lossy(&response.body));
                return (Placed::Refused, retries);
            }
            _ if Instant::now() > deadline => return (Placed::Unanswered, retries),
            _ => {
                retries += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// One to three lines: mostly everyday SKUs; some SKU-5 (scarce), unknown SKUs (rejected),
/// FLAKY-1 (succeeds on its third attempt) and POISON-1 (quarantined).
fn random_order(rng: &mut fastrand::Rng) -> (String, bool) {
    let mut lines = Vec::new();
    let mut poison = false;
    for _ in 0..rng.usize(1..=3) {
        let sku = match rng.u32(0..100) {
            0..=1 => "NOPE-9",
            2..=4 => "FLAKY-1",
            5 => {
                poison = true;
                "POISON-1"
            }
            6..=9 => "SKU-5",
            n => ["SKU-1", "SKU-2", "SKU-3", "SKU-4"][n as usize % 4],
        };
        lines.push(serde_json::json!({"sku": sku, "quantity": rng.i32(1..=3)}));
    }
    (serde_json::json!({"customerId": "chaos", "lines": lines}).to_string(), poison)
}

/// Spread `kills` and `cuts` evenly over the expected duration of the load, in random order, on
/// random services.
async fn wreak(shop: &mut ProcessShop, args: &Args, expected: Duration) -> Havoc {
    let mut havoc = Havoc::default();
    let mut faults: Vec<bool> =
        std::iter::repeat_n(true, args.kills).chain(std::iter::repeat_n(false, args.cuts)).collect();
    fastrand::shuffle(&mut faults);
    let gap = expected.div_f64(faults.len() as f64 + 1.0);
    for kill in faults {
        tokio::time::sleep(gap).await;
        let service = Service::ALL[fastrand::usize(..Service::ALL.len())];
        if kill {
            if let Err(status) = shop.process(service).check_running() {
                havoc.self_exits.push(format!("{service:?}: {status}"));
            }
            shop.kill(service).await;
            *havoc.kills.entry(service.binary()).or_default() += 1;
            tokio::time::sleep(Duration::from_millis(fastrand::u64(100..1000))).await;
            shop.restart(service).await;
        } else {
            let proxy = if fastrand::bool() { shop.database_proxy(service) } else { shop.broker_proxy(service) };
            if fastrand::u8(0..4) == 0 {
                proxy.stall();
                havoc.stalls += 1;
            } else {
                proxy.cut();
                havoc.cuts += 1;
            }
            tokio::time::sleep(Duration::from_millis(fastrand::u64(1000..3000))).await;
            proxy.restore();
        }
    }
    for service in Service::ALL {
        if let Err(status) = shop.process(service).check_running() {
            havoc.self_exits.push(format!("{service:?}: {status}"));
        }
    }
    havoc
}
