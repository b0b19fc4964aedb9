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
//!
//! With `--instances 2` every service runs twice (the APIs behind one load balancer), and a kill or
//! a cut takes one instance. On the three-node cluster of `.ci/rabbitmq-cluster`
//! (`TEST_CLUSTER_CTL` set, as its `env` prints), `--node-kills` kill the node leading a work
//! queue, `--node-stops` stop a node as an operator would, and `--partitions` cut a node off from
//! the other two and from every client for half a minute, `--quorum-losses` kill two nodes of three
//! (every quorum queue loses its majority) and start one of them again after 10 to 20 s, and
//! `--alarms` raise a memory alarm on one node for 10 to 20 s, which blocks every publisher of
//! the cluster (`just chaos-cluster`). After each fault
//! the soak waits until every order accepted before it ended has settled, and reports how long
//! that took (the fault's ride-out) for each kind of fault.
//!
//! `--crash-orders` of the orders name CRASH-1, which makes the inventory worker exit every time it
//! handles one; the soak restarts a worker that exits that way, as a supervisor would, and expects
//! each such order to end quarantined by the crash bound, taking no other order with it.

use std::{
    collections::BTreeMap,
    process::ExitCode,
    sync::{Arc, Mutex},
    time::Duration,
};

use clap::Parser;
use shop_demo::CRASH_EXIT_CODE;
use testkit::{
    cluster::Cluster,
    http,
    ledger::Ledger,
    shop::{Instance, Options, Service, Shop},
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
    /// Orders naming CRASH-1, spread evenly over the run.
    #[arg(long, default_value_t = 3)]
    crash_orders: usize,
    /// Instances of each service (the APIs behind one load balancer).
    #[arg(long, default_value_t = 1)]
    instances: usize,
    /// Kills (`kill -9`) of the broker node leading a work queue, each brought back (cluster).
    #[arg(long, default_value_t = 0)]
    node_kills: usize,
    /// Stops of a broker node as an operator stops it, each started again (cluster).
    #[arg(long, default_value_t = 0)]
    node_stops: usize,
    /// Partitions of a broker node from the other two and from every client, healed after 25 to
    /// 35 s (cluster).
    #[arg(long, default_value_t = 0)]
    partitions: usize,
    /// Kills of two broker nodes of three (every quorum queue loses its majority), one of them
    /// started again after 10 to 20 s, the other once the orders settled (cluster).
    #[arg(long, default_value_t = 0)]
    quorum_losses: usize,
    /// Memory alarms raised on a broker node for 10 to 20 s (cluster).
    #[arg(long, default_value_t = 0)]
    alarms: usize,
    /// A fault not ridden out (every order accepted before it ended settled) within this many
    /// seconds fails the run.
    #[arg(long, default_value_t = 180)]
    ride_out_secs: u64,
}

/// The queues consumers work from, one of whose leaders a node kill takes.
const WORK_QUEUES: [&str; 3] = ["inventory.order-placed", "billing.inventory-reserved", "orders.status"];

/// One fault the soak injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    /// `kill -9` of a service instance, restarted after 0.1 to 1 s.
    Kill,
    /// A cut or stall of one instance's connections to Postgres or RabbitMQ, for 1 to 3 s.
    Cut,
    /// `kill -9` of the broker node leading a work queue, started again after 5 to 15 s.
    NodeKill,
    /// A broker node stopped by `rabbitmqctl stop`, started again after 5 to 15 s.
    NodeStop,
    /// A broker node cut off from the other nodes and every client for 25 to 35 s.
    Partition,
    /// Two broker nodes of three killed; one started again after 10 to 20 s.
    QuorumLoss,
    /// A memory alarm on one broker node for 10 to 20 s: every publisher of the cluster blocked.
    Alarm,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Self::Kill => "service kill",
            Self::Cut => "connection cut/stall",
            Self::NodeKill => "node kill (queue leader)",
            Self::NodeStop => "node stop",
            Self::Partition => "node partition",
            Self::QuorumLoss => "two nodes of three killed",
            Self::Alarm => "memory alarm",
        }
    }
}

/// Job ids the API has accepted so far, shared between the load and the havoc.
type Accepted = Arc<Mutex<Vec<Uuid>>>;

/// What the client saw.
#[derive(Debug, Default)]
struct Driven {
    /// Accepted orders naming POISON-1 (and not CRASH-1), or BILLPOISON-1, not cancelled.
    poison: usize,
    /// Accepted orders naming BILLPOISON-1 (parked in billing, after inventory reserved them).
    bill_poison: usize,
    /// Orders whose cancel was answered 202: each must end `cancelled`.
    cancelled: usize,
    /// Cancels answered 409: the order had ended otherwise first.
    too_late: usize,
    /// Accepted orders naming CRASH-1, not cancelled. With the poison ones, the only ones that may
    /// end quarantined.
    crashing: usize,
    /// Accepted orders naming CRASH-1, cancelled or not: a cancel does not withdraw the
    /// `order.placed` that crashes the worker.
    crash_sent: usize,
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
    kills: BTreeMap<String, usize>,
    cuts: usize,
    stalls: usize,
    /// How long each fault took to ride out, by kind: from its start, and from its end (the
    /// service restarted, the connection restored, the cluster whole again).
    ride_outs: BTreeMap<Fault, Vec<(Duration, Duration)>>,
    /// Faults whose orders had not settled within `--ride-out-secs`.
    not_ridden_out: Vec<String>,
    /// Services that exited without being killed, other than by a demo crash.
    self_exits: Vec<String>,
    /// Workers that exited by a demo crash (CRASH-1), restarted at once.
    crash_exits: usize,
}

impl Havoc {
    /// Restart every service that exited by itself, as a supervisor would: a demo crash is
    /// expected, any other exit is recorded as a failure.
    async fn supervise(&mut self, shop: &mut Shop) {
        for instance in shop.instances() {
            let Some(status) = shop.process(instance).take_exit() else { continue };
            if status.code() == Some(CRASH_EXIT_CODE) {
                self.crash_exits += 1;
            } else {
                self.self_exits.push(format!("{instance}: {status}"));
            }
            shop.process(instance).start();
        }
    }

    /// Supervise until `task` (bringing the cluster back) ends.
    async fn supervise_until(&mut self, shop: &mut Shop, mut task: tokio::task::JoinHandle<()>) {
        loop {
            self.supervise(shop).await;
            tokio::select! {
                joined = &mut task => {
                    joined.expect("the cluster's script");
                    return;
                }
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    }

    /// Supervise until every order in `accepted` has settled, and record how long `fault`, begun
    /// at `began`, took to ride out.
    async fn ride_out(&mut self, shop: &mut Shop, fault: Fault, began: Instant, accepted: &[Uuid], limit: Duration) {
        let ended = Instant::now();
        let deadline = began + limit;
        loop {
            self.supervise(shop).await;
            let unsettled: i64 = sqlx::query_scalar(
                "select count(*) from jobs where id = any($1) and state in ('queued', 'published', 'retry_wait')",
            )
            .bind(accepted)
            .fetch_one(&shop.orders)
            .await
            .unwrap_or(i64::MAX);
            if unsettled == 0 {
                self.ride_outs.entry(fault).or_default().push((began.elapsed(), ended.elapsed()));
                return;
            }
            if Instant::now() >= deadline {
                self.not_ridden_out.push(format!("{}: {unsettled} orders unsettled after {limit:?}", fault.name()));
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Supervise for `duration`.
    async fn supervise_for(&mut self, shop: &mut Shop, duration: Duration) {
        let until = Instant::now() + duration;
        while Instant::now() < until {
            self.supervise(shop).await;
            tokio::time::sleep(Duration::from_millis(100).min(until - Instant::now())).await;
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    fastrand::seed(seed);
    let cluster = Cluster::from_env().await;
    if args.node_kills + args.node_stops + args.partitions + args.quorum_losses + args.alarms > 0 && cluster.is_none() {
        eprintln!("chaos: node faults need the cluster: eval \"$(.ci/rabbitmq-cluster env)\" first");
        return ExitCode::from(2);
    }
    // Whole before the first fault, whatever ran on it before (a failed suite may leave a node
    // down or cut off).
    if let Some(cluster) = &cluster {
        cluster.restore().await;
    }
    println!(
        "chaos: {} orders at {}/s, {} instance(s) of each service; {} kills, {} cuts, {} node kills, {} node stops, \
         {} partitions, {} quorum losses, {} alarms; seed {seed}",
        args.orders,
        args.rate,
        args.instances,
        args.kills,
        args.cuts,
        args.node_kills,
        args.node_stops,
        args.partitions,
        args.quorum_losses,
        args.alarms
    );

    let options = Options {
        retry_delays: "100ms,500ms,1s".into(),
        max_attempts: 4,
        demo_faults: true,
        log_filter: "warn,messaging::consumer=info".into(),
        instances: args.instances.max(1),
        ..Options::default()
    };
    let mut shop = Shop::start(options).await;
    // Ample stock for the everyday SKUs; SKU-5 keeps its 10 so that some orders are refused.
    shop.restock("SKU-_", 1_000_000).await;
    shop.restock("SKU-5", 10).await;
    println!("chaos: services up, logs in {}", shop.log_dir().display());

    let started = Instant::now();
    let expected = Duration::from_secs_f64(args.orders as f64 / args.rate);
    let api = shop.front();
    let accepted = Accepted::default();
    let (driven, mut havoc) = tokio::join!(
        drive(&api, args.orders, args.rate, args.crash_orders, fastrand::u64(..), &accepted),
        wreak(&mut shop, &args, cluster.as_ref(), started + expected, &accepted)
    );
    let havoc_ended = started.elapsed();
    for instance in shop.instances() {
        if shop.process(instance).check_running() == Ok(false) {
            shop.restart(instance).await;
        }
    }
    shop.accepted = accepted.lock().expect("accepted ids").clone();
    let settle_deadline = Instant::now() + Duration::from_secs(args.settle_secs);
    let ledger = loop {
        havoc.supervise(&mut shop).await;
        let ledger = shop.ledger().await;
        if ledger.is_settled() || Instant::now() >= settle_deadline {
            break ledger;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let settled_in = started.elapsed();
    let consumers = shop.instances().into_iter().filter(|instance| instance.service != Service::Relay);
    let duplicates: usize =
        consumers.map(|instance| shop.process(instance).log_count("duplicate skipped by the inbox")).sum();

    // The books as the orders service checks them in production (shop_books): once the shop has
    // settled, nothing may disagree.
    let books = shop_books::Books {
        orders: shop.orders.clone(),
        inventory: shop.inventory.clone(),
        billing: shop.billing.clone(),
    };
    let horizon = shop_books::Horizon { grace: Duration::ZERO, ..shop_books::Horizon::default() };
    let disagreements = books.check(horizon).await.expect("check the books");
    // The job model as the orders database checks it in production (migration 0014).
    let forbidden = testkit::ledger::forbidden_job_moves(&shop.orders).await;

    println!("\n== ledger ==\n{ledger}");
    println!("books' disagreements {:>8}  (shop_books, as the orders service counts them)", disagreements.len());
    for disagreement in &disagreements {
        println!("  {disagreement}");
    }
    let moves: i64 = forbidden.iter().map(|(_, _, moves)| moves).sum();
    println!("forbidden job moves  {moves:>8}  (job_moves_forbidden, as the orders service exports them)");
    for (from, to, moves) in &forbidden {
        println!("  {from} -> {to}: {moves}");
    }
    println!("\n== run ==");
    let placed = driven.took.as_secs_f64();
    println!("orders placed in     {placed:>8.1} s  ({:.1}/s; {} offered)", args.orders as f64 / placed, args.rate);
    println!("faults ended after   {:>8.1} s", havoc_ended.as_secs_f64());
    println!("all settled after    {:>8.1} s", settled_in.as_secs_f64());
    report(&driven, &havoc, duplicates);
    let mut failures = failures(&ledger, &driven, &havoc);
    if !disagreements.is_empty() {
        failures.push(format!("{} disagreements between the books", disagreements.len()));
    }
    if moves > 0 {
        failures.push(format!("{moves} job moves the job model forbids"));
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

/// What the drive and the havoc did, after the ledger and the times.
fn report(driven: &Driven, havoc: &Havoc, duplicates: usize) {
    println!("kills                {:>8}  {:?}", havoc.kills.values().sum::<usize>(), havoc.kills);
    println!("cuts / stalls        {:>8}  / {}", havoc.cuts, havoc.stalls);
    println!("client retries       {:>8}", driven.retries);
    println!("duplicates skipped   {:>8}  (by the inboxes, from the logs)", duplicates);
    println!(
        "poison orders        {:>8}  (quarantined after MAX_ATTEMPTS; {} of them in billing)",
        driven.poison, driven.bill_poison
    );
    println!(
        "cancelled orders     {:>8}  (202; {} more cancels came too late: 409)",
        driven.cancelled, driven.too_late
    );
    println!(
        "crashing orders      {:>8}  (quarantined by the crash bound; {} sent, cancels included)",
        driven.crashing, driven.crash_sent
    );
    println!("demo crash exits     {:>8}  (workers restarted)", havoc.crash_exits);
    println!("\n== ride-out: until every order accepted before the fault ended settled, in s ==");
    println!(
        "{:<26} {:>6}  {:>22}  {:>22}",
        "fault", "count", "from its start: median p90 max", "from its end: median p90 max"
    );
    for (fault, times) in &havoc.ride_outs {
        let quantiles = |mut times: Vec<Duration>| {
            times.sort();
            let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize].as_secs_f64();
            format!("{:>6.1} {:>6.1} {:>6.1}", at(0.5), at(0.9), at(1.0))
        };
        let from_start = quantiles(times.iter().map(|(start, _)| *start).collect());
        let from_end = quantiles(times.iter().map(|(_, end)| *end).collect());
        println!("{:<26} {:>6}  {from_start:>30}  {from_end:>29}", fault.name(), times.len());
    }
}

/// Why the run failed: nothing if it passed.
fn failures(ledger: &Ledger, driven: &Driven, havoc: &Havoc) -> Vec<String> {
    let mut failures = Vec::new();
    if !ledger.is_clean() {
        failures.push("the ledger does not balance".to_owned());
    }
    let expected_quarantined = (driven.poison + driven.crashing) as i64;
    if ledger.quarantined != expected_quarantined {
        failures.push(format!(
            "{} quarantined, but {} poison and {} crashing orders",
            ledger.quarantined, driven.poison, driven.crashing
        ));
    }
    // Each crashing order, cancelled or not: one crash among other deliveries, then MAX_CRASHES
    // (3) alone; a kill or a cut while it is held can add one. (A copy the relay publishes again,
    // its mark lost, crashes the worker anew: parked, the message left no inbox row.)
    if havoc.crash_exits > driven.crash_sent * 6 {
        failures.push(format!("{} crash exits for {} crashing orders", havoc.crash_exits, driven.crash_sent));
    }
    // A cancel answered 202 decided the order's end: nothing else can have ended it.
    if ledger.cancelled != driven.cancelled as i64 {
        failures.push(format!("{} cancelled, but {} cancels answered 202", ledger.cancelled, driven.cancelled));
    }
    if driven.refused + driven.unanswered > 0 {
        failures.push(format!("{} orders refused, {} unanswered", driven.refused, driven.unanswered));
    }
    if !havoc.self_exits.is_empty() {
        failures.push(format!("services exited by themselves: {:?}", havoc.self_exits));
    }
    if !havoc.not_ridden_out.is_empty() {
        failures.push(format!("faults not ridden out: {:?}", havoc.not_ridden_out));
    }
    failures
}

/// Offer `orders` at `rate` per second, `crashing` of them naming CRASH-1, each in its own task so
/// an outage does not lower the offered load; each retries with its Idempotency-Key until answered.
async fn drive(api: &str, orders: usize, rate: f64, crashing: usize, seed: u64, accepted: &Accepted) -> Driven {
    let mut rng = fastrand::Rng::with_seed(seed);
    let run = Uuid::new_v4().simple().to_string();
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = JoinSet::new();
    let mut driven = Driven::default();
    let started = Instant::now();
    let crash_every = (orders / (crashing + 1)).max(1);
    for i in 0..orders {
        ticks.tick().await;
        let crash = crashing > 0 && i % crash_every == crash_every / 2 && i / crash_every < crashing;
        let (body, kind) = if crash { (crash_order(), Kind::Crashing) } else { random_order(&mut rng) };
        // Three orders in a hundred are cancelled by their customer, at a random moment of their
        // first two seconds: before the relay publishes, mid-flight, or after the invoice (409).
        let cancel_after = (rng.u32(0..100) < 3).then(|| Duration::from_millis(rng.u64(0..2000)));
        let key = format!("chaos-{run}-{i}");
        let api = api.to_owned();
        let accepted = Arc::clone(accepted);
        tasks.spawn(async move {
            let placed = place(&format!("{api}/orders"), &body, &key).await;
            let mut cancelled = None;
            if let (Placed::Accepted(job_id, order_id), _) = placed {
                accepted.lock().expect("accepted ids").push(job_id);
                if let Some(after) = cancel_after {
                    tokio::time::sleep(after).await;
                    cancelled = Some(cancel(&format!("{api}/orders/{order_id}/cancel")).await);
                }
            }
            (placed, kind, cancelled)
        });
    }
    while let Some(joined) = tasks.join_next().await {
        let ((outcome, retries), kind, cancelled) = joined.expect("order task");
        driven.retries += retries;
        match outcome {
            Placed::Accepted(..) => {
                // A cancelled order ends `cancelled`, whatever it would have ended as.
                let quarantines = cancelled != Some(Cancelled::Yes);
                driven.poison += usize::from(quarantines && matches!(kind, Kind::Poison | Kind::BillPoison));
                driven.bill_poison += usize::from(kind == Kind::BillPoison);
                driven.crashing += usize::from(quarantines && kind == Kind::Crashing);
                driven.crash_sent += usize::from(kind == Kind::Crashing);
            }
            Placed::Refused => driven.refused += 1,
            Placed::Unanswered => driven.unanswered += 1,
        }
        match cancelled {
            Some(Cancelled::Yes) => driven.cancelled += 1,
            Some(Cancelled::TooLate) => driven.too_late += 1,
            Some(Cancelled::Unanswered) => driven.unanswered += 1,
            None => {}
        }
    }
    driven.took = started.elapsed();
    driven
}

/// How a customer's cancel was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cancelled {
    /// 202: the order ends `cancelled`.
    Yes,
    /// 409: it had ended otherwise.
    TooLate,
    /// Nothing but 5xx and timeouts for a minute.
    Unanswered,
}

/// Cancel, repeating through outages (it is idempotent) until answered.
async fn cancel(url: &str) -> Cancelled {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let operator = testkit::auth::bearer(&testkit::auth::operator());
        let headers = [("Authorization", operator.as_str())];
        let attempt = http::request("POST", url, &headers, None);
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(response)) if response.status == 202 => return Cancelled::Yes,
            Ok(Ok(response)) if response.status == 409 => return Cancelled::TooLate,
            _ if Instant::now() > deadline => return Cancelled::Unanswered,
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

enum Placed {
    /// The job and the order.
    Accepted(Uuid, Uuid),
    Refused,
    Unanswered,
}

async fn place(url: &str, body: &str, key: &str) -> (Placed, usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut retries = 0;
    loop {
        let operator = testkit::auth::bearer(&testkit::auth::operator());
        let headers = [("Idempotency-Key", key), ("Authorization", &operator)];
        let attempt = http::request("POST", url, &headers, Some(body));
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(response)) if response.status == 202 => {
                let body = response.json();
                let id = |name: &str| body[name].as_str().and_then(|id| id.parse().ok()).expect("ids");
                return (Placed::Accepted(id("jobId"), id("orderId")), retries);
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

/// How an order is expected to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Succeeded or rejected.
    Plain,
    /// Quarantined after MAX_ATTEMPTS.
    Poison,
    /// Quarantined by the crash bound.
    Crashing,
    /// Quarantined in billing after MAX_ATTEMPTS, its stock held.
    BillPoison,
}

/// An order that billing fails on every attempt, after inventory has reserved it (no scarce or
/// unknown SKU beside it, so that inventory always does).
fn bill_poison_order() -> String {
    serde_json::json!({"customerId": "chaos", "lines": [{"sku": "SKU-1", "quantity": 1}, {"sku": "BILLPOISON-1", "quantity": 1}]})
        .to_string()
}

/// An order whose line makes the inventory worker exit.
fn crash_order() -> String {
    serde_json::json!({"customerId": "chaos", "lines": [{"sku": "CRASH-1", "quantity": 1}]}).to_string()
}

/// One to three lines: mostly everyday SKUs; some SKU-5 (scarce), unknown SKUs (rejected),
/// FLAKY-1 (succeeds on its third attempt), POISON-1 (quarantined) and DECLINE-1 (declined by
/// billing, its stock given back); one order in a hundred is a BILLPOISON order (quarantined in
/// billing with its stock held).
fn random_order(rng: &mut fastrand::Rng) -> (String, Kind) {
    if rng.u32(0..100) == 0 {
        return (bill_poison_order(), Kind::BillPoison);
    }
    let mut lines = Vec::new();
    let mut kind = Kind::Plain;
    for _ in 0..rng.usize(1..=3) {
        let sku = match rng.u32(0..100) {
            0..=1 => "NOPE-9",
            2..=4 => "FLAKY-1",
            5 => {
                kind = Kind::Poison;
                "POISON-1"
            }
            6..=9 => "SKU-5",
            10..=11 => "DECLINE-1",
            n => ["SKU-1", "SKU-2", "SKU-3", "SKU-4"][n as usize % 4],
        };
        lines.push(serde_json::json!({"sku": sku, "quantity": rng.i32(1..=3)}));
    }
    (serde_json::json!({"customerId": "chaos", "lines": lines}).to_string(), kind)
}

/// Spread the faults over the load (until `end`), in random order: service faults on random
/// instances, node faults on random nodes (a node kill on the leader of a random work queue).
/// After each, wait until every order accepted before it ended has settled (its ride-out).
async fn wreak(shop: &mut Shop, args: &Args, cluster: Option<&Cluster>, end: Instant, accepted: &Accepted) -> Havoc {
    let mut havoc = Havoc::default();
    let counts = [
        (Fault::Kill, args.kills),
        (Fault::Cut, args.cuts),
        (Fault::NodeKill, args.node_kills),
        (Fault::NodeStop, args.node_stops),
        (Fault::Partition, args.partitions),
        (Fault::QuorumLoss, args.quorum_losses),
        (Fault::Alarm, args.alarms),
    ];
    let mut faults: Vec<Fault> = counts.into_iter().flat_map(|(fault, n)| std::iter::repeat_n(fault, n)).collect();
    fastrand::shuffle(&mut faults);
    let limit = Duration::from_secs(args.ride_out_secs);
    let instances = shop.instances();
    for (done, fault) in faults.iter().copied().enumerate() {
        // Spread what is left evenly over what is left of the load (faults ride out in turn).
        let gap = end.saturating_duration_since(Instant::now()) / u32::try_from(faults.len() - done + 1).unwrap_or(1);
        havoc.supervise_for(shop, gap.max(Duration::from_secs(1))).await;
        let began = Instant::now();
        match (fault, cluster) {
            (Fault::Kill, _) => {
                let instance = instances[fastrand::usize(..instances.len())];
                havoc.supervise(shop).await;
                shop.kill(instance).await;
                *havoc.kills.entry(instance.to_string()).or_default() += 1;
                havoc.supervise_for(shop, Duration::from_millis(fastrand::u64(100..1000))).await;
                shop.process(instance).start();
            }
            (Fault::Cut, _) => cut(shop, instances[fastrand::usize(..instances.len())], &mut havoc).await,
            (_, Some(cluster)) => node_fault(shop, cluster, fault, &mut havoc).await,
            (_, None) => unreachable!("node faults need the cluster (checked at start)"),
        }
        let upto = accepted.lock().expect("accepted ids").clone();
        havoc.ride_out(shop, fault, began, &upto, limit).await;
        if let (Fault::QuorumLoss, Some(cluster)) = (fault, cluster) {
            // The majority came back with one node; the other one now, for the next fault.
            havoc.supervise_until(shop, restore(cluster)).await;
        }
    }
    havoc.supervise(shop).await;
    havoc
}

/// Cut or stall one instance's connections to Postgres or RabbitMQ for 1 to 3 s.
async fn cut(shop: &mut Shop, instance: Instance, havoc: &mut Havoc) {
    let proxy = if fastrand::bool() { shop.database_proxy(instance) } else { shop.broker_proxy(instance) };
    if fastrand::u8(0..4) == 0 {
        proxy.stall();
        havoc.stalls += 1;
    } else {
        proxy.cut();
        havoc.cuts += 1;
    }
    let outage = Duration::from_millis(fastrand::u64(1000..3000));
    tokio::time::sleep(outage).await;
    proxy.restore();
}

/// Take a broker node down (kill the leader of a random work queue, stop a random node, or cut
/// one off), supervise the services meanwhile, then bring the cluster back whole. Or take two
/// down and bring one back, or raise a memory alarm and clear it.
async fn node_fault(shop: &mut Shop, cluster: &Cluster, fault: Fault, havoc: &mut Havoc) {
    let random_node = || 1 + fastrand::usize(..cluster.len());
    match fault {
        Fault::QuorumLoss => return quorum_loss(shop, cluster, havoc).await,
        Fault::Alarm => return alarm(shop, cluster, random_node(), havoc).await,
        _ => {}
    }
    let (node, down_for) = match fault {
        Fault::NodeKill => {
            let queue = WORK_QUEUES[fastrand::usize(..WORK_QUEUES.len())];
            let node = cluster.leader(shop.env.vhost(), queue).await.unwrap_or_else(random_node);
            cluster.kill(node).await;
            (node, fastrand::u64(5..15))
        }
        Fault::NodeStop => {
            let node = random_node();
            cluster.stop(node).await;
            (node, fastrand::u64(5..15))
        }
        Fault::Partition => {
            let node = random_node();
            cluster.partition(node).await;
            (node, fastrand::u64(25..35))
        }
        Fault::Kill | Fault::Cut => unreachable!("a service fault"),
        Fault::QuorumLoss | Fault::Alarm => unreachable!("handled above"),
    };
    println!("chaos: {} of {} for {down_for} s", fault.name(), cluster.name(node));
    havoc.supervise_for(shop, Duration::from_secs(down_for)).await;
    havoc.supervise_until(shop, restore(cluster)).await;
}

/// Bring the cluster back whole, in a task (the services are supervised meanwhile).
fn restore(cluster: &Cluster) -> tokio::task::JoinHandle<()> {
    let cluster = cluster.clone();
    tokio::spawn(async move { cluster.restore().await })
}

/// Kill two nodes of three, and start one of them again after 10 to 20 s: the majority is back,
/// the third node still down.
async fn quorum_loss(shop: &mut Shop, cluster: &Cluster, havoc: &mut Havoc) {
    let mut nodes: Vec<usize> = (1..=cluster.len()).collect();
    fastrand::shuffle(&mut nodes);
    let (first, second) = (nodes[0], nodes[1]);
    cluster.kill(first).await;
    cluster.kill(second).await;
    let down_for = fastrand::u64(10..20);
    println!(
        "chaos: {} and {} killed; {} back after {down_for} s",
        cluster.name(first),
        cluster.name(second),
        cluster.name(first)
    );
    havoc.supervise_for(shop, Duration::from_secs(down_for)).await;
    let start = tokio::spawn({
        let cluster = cluster.clone();
        async move { cluster.start(first).await }
    });
    havoc.supervise_until(shop, start).await;
}

/// A memory alarm on `node` for 10 to 20 s, its watermark put back as it was.
async fn alarm(shop: &mut Shop, cluster: &Cluster, node: usize, havoc: &mut Havoc) {
    let before = cluster.ctl(node, &["-q", "eval", "vm_memory_monitor:get_vm_memory_high_watermark()."]).await;
    cluster.ctl(node, &["set_vm_memory_high_watermark", "0.0000001"]).await;
    let held = fastrand::u64(10..20);
    println!("chaos: memory alarm on {} for {held} s", cluster.name(node));
    havoc.supervise_for(shop, Duration::from_secs(held)).await;
    let restore = format!("vm_memory_monitor:set_vm_memory_high_watermark({before}).");
    cluster.ctl(node, &["-q", "eval", &restore]).await;
}
