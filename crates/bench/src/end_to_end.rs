//! The end-to-end section: every service together, against the same run's baseline (one message
//! per transaction), on hot SKUs and a wide catalog. Two capacities, named apart: D, the rate at
//! which the shop drains a burst, and M, the highest open-loop paced rate it sustains; latency at
//! 25, 50 and 90 % of M with where the time goes and what an order costs there; commit -> publish;
//! each service's peak memory; then two instances of every service (the APIs behind one balancer)
//! on hot SKUs.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use testkit::{
    process::Process,
    proxy::Balancer,
    shop::{Instance, Service},
};

use super::{Bench, WIDE_CATALOG};
use crate::{
    limits::Catalog,
    open_loop::{self, Ends, Latency, Offered, Phase, Search},
    report::Report,
    stages::{self, Cpu, Usage, percentiles, start_as, stop},
};

/// The shares of M latency is measured at, unless `--loads` says otherwise.
pub(super) const LOADS: [f64; 3] = [0.25, 0.5, 0.9];

/// Where M's search starts, as a share of D.
const SEARCH_FROM: f64 = 0.3;

/// How many times each latency phase runs: each quantile reported is the median of these.
const REPEATS: u64 = 2;

/// Where the time goes between the steps [`stages::order_steps`] reads: the span ending at each
/// step, starting at the one before (the first, at the order's due time).
const SPANS: [&str; 7] = [
    "due -> the API's transaction (load, HTTP, API)",
    "-> order.placed claimed (API tx, orders outbox)",
    "-> inventory's tx (publish, queue, batch wait)",
    "-> inventory.reserved claimed (tx, outbox)",
    "-> billing's tx (publish, queue, batch wait)",
    "-> invoice.created claimed (tx, outbox)",
    "-> succeeded (publish, queue, status consumer)",
];

/// What the end-to-end section measured that the targets check.
pub(super) struct EndToEnd {
    /// CPU seconds per order at the shipped defaults on hot SKUs.
    pub(super) cpu: Cpu,
    /// CPU seconds per order at the baseline (one message per transaction).
    pub(super) cpu_unbatched: Cpu,
    /// D: the drain of a burst at the shipped defaults on hot SKUs, orders/s.
    pub(super) drain: f64,
    /// M: the highest open-loop paced rate sustained, orders/s, if any rate was.
    pub(super) capacity: Option<f64>,
    /// What each share of M measured ([`LOADS`]).
    pub(super) at_shares: Vec<AtShare>,
    /// Commit -> publish p50 and p99, ms.
    pub(super) commit_to_publish: (f64, f64),
    /// The largest service's peak RSS, MiB.
    pub(super) peak_rss: f64,
}

/// What a share of M measured.
pub(super) struct AtShare {
    /// The share of M.
    pub(super) share: f64,
    /// POST -> succeeded, each quantile the median of the repeats.
    pub(super) latency: Latency,
    /// CPU seconds per order, every process together.
    pub(super) cpu: f64,
}

/// How long [`Bench::idle`] watches the idle shop.
const IDLE_WINDOW: Duration = Duration::from_secs(20);

/// What the idle shop costs.
struct Idle {
    /// CPU seconds a second, every process together.
    cpu_per_second: f64,
}

/// What an end-to-end phase cost.
struct PhaseCost {
    /// CPU seconds per order of each service process.
    services: Vec<(String, f64)>,
    /// CPU seconds per order: the services together, Postgres, RabbitMQ.
    cpu: Cpu,
    /// Transactions committed in the three databases, per order.
    commits: f64,
    /// Deadlocks Postgres broke in the three databases over the phase: each failed one
    /// transaction (a batch, one message's, a relay's mark), which was then tried again.
    deadlocks: i64,
    /// Wake-ups per order ([`stages::wake_ups`]) of each service process, then of every Postgres
    /// and every RabbitMQ process together.
    wake_ups: Vec<(String, f64)>,
    /// Of each service process's wake-ups per order, those of lapin's I/O threads
    /// ([`stages::LAPIN_IO_THREAD`]), which an AMQP client doing its I/O on tokio's workers would
    /// not have.
    io_wake_ups: Vec<f64>,
    /// The machine's busy share over the phase (0 to 1).
    busy: f64,
}

impl PhaseCost {
    /// (wake-ups, CPU seconds) per order, every process together.
    fn point(&self) -> (f64, f64) {
        (self.wake_ups.iter().map(|(_, count)| count).sum(), self.cpu.total())
    }

    /// Print it under `label`.
    fn report(&self, report: &mut Report, label: &str) {
        let servers =
            [("postgres (all)".to_owned(), self.cpu.postgres), ("rabbitmq (all)".to_owned(), self.cpu.rabbitmq)];
        for (name, seconds) in self.services.iter().chain(&servers) {
            report.figure("cpu", &format!("{label}: {name}"), seconds * 1e6, "us/ord", "CPU time per order");
        }
        let mut io = self.io_wake_ups.iter();
        for (name, wake_ups) in &self.wake_ups {
            let note = "times its threads slept and were woken, per order";
            report.figure("wake-ups", &format!("{label}: {name}"), *wake_ups, "/ord", note);
            if let Some(io) = io.next() {
                let note = "of which lapin's I/O threads";
                report.figure("wake-ups", &format!("{label}: {name}, lapin I/O"), *io, "/ord", note);
            }
        }
        let note = "transactions committed in the three databases, per order";
        report.figure("cpu", &format!("{label}: commits"), self.commits, "/ord", note);
        // A backend sleeps until its client's next message arrives, so its wake-ups bound the
        // round trips from above (Postgres's own background processes add theirs).
        if let Some((_, postgres)) = self.wake_ups.iter().find(|(name, _)| name == POSTGRES) {
            let note = "postgres wake-ups per commit: at most, round trips per transaction";
            report.figure("cpu", &format!("{label}: round trips"), postgres / self.commits, "/tx", note);
        }
        let note = "deadlocks Postgres broke in the three databases over the phase";
        report.figure("cpu", &format!("{label}: deadlocks"), self.deadlocks as f64, "", note);
        let note = "share of the machine's CPU time in use over the phase";
        report.figure("cpu", &format!("{label}: machine busy"), self.busy * 100.0, "%", note);
        report.figure("cpu", &format!("{label}: all of the above"), self.cpu.total() * 1e6, "us/ord", "");
    }
}

/// What a phase has cost so far: opened by [`Bench::meter`].
struct Meter {
    /// Each service process, by name.
    pids: Vec<(String, u32)>,
    /// Each one's CPU seconds at the start.
    each: Vec<f64>,
    /// Wake-ups at the start: each process's, then Postgres's and RabbitMQ's.
    wake_ups: Vec<u64>,
    /// Each process's lapin I/O threads' wake-ups at the start.
    io_wake_ups: Vec<u64>,
    window: Usage,
    /// Commits and deadlocks in the three databases at the start.
    counts: stages::DatabaseCounts,
}

impl Meter {
    /// What the phase cost per order, over `orders` orders.
    async fn finish(self, bench: &Bench, orders: usize) -> PhaseCost {
        let used = self.window.finish();
        let n = orders as f64;
        let services = self
            .pids
            .iter()
            .zip(&self.each)
            .map(|((name, pid), was)| (name.clone(), (stages::cpu_seconds(*pid) - was) / n))
            .collect();
        let wake_ups = wake_ups(&self.pids)
            .into_iter()
            .zip(&self.wake_ups)
            .map(|((name, now), was)| (name, now.saturating_sub(*was) as f64 / n))
            .collect();
        let io_wake_ups = io_wake_ups(&self.pids)
            .into_iter()
            .zip(&self.io_wake_ups)
            .map(|(now, was)| now.saturating_sub(*was) as f64 / n)
            .collect();
        let counts = stages::database_counts(&bench.orders, &bench.databases()).await;
        PhaseCost {
            services,
            cpu: used.cpu.per(n),
            commits: (counts.commits - self.counts.commits) as f64 / n,
            deadlocks: counts.deadlocks - self.counts.deadlocks,
            wake_ups,
            io_wake_ups,
            busy: used.busy,
        }
    }
}

/// The name every Postgres process's wake-ups are reported under.
const POSTGRES: &str = "postgres (all)";

/// Wake-ups so far of each of `pids`, then of every Postgres and every RabbitMQ process.
fn wake_ups(pids: &[(String, u32)]) -> Vec<(String, u64)> {
    let servers = [(POSTGRES, "postgres"), ("rabbitmq (all)", "beam.smp")];
    let services = pids.iter().map(|(name, pid)| (name.clone(), stages::wake_ups(*pid)));
    services.chain(servers.map(|(name, comm)| (name.to_owned(), stages::wake_ups_of(comm)))).collect()
}

/// Wake-ups so far of each of `pids`' lapin I/O threads.
fn io_wake_ups(pids: &[(String, u32)]) -> Vec<u64> {
    pids.iter().map(|(_, pid)| stages::thread_wake_ups(*pid, |thread| thread == stages::LAPIN_IO_THREAD)).collect()
}

/// The least-squares line through each phase's (wake-ups, CPU) per order, and the share of the
/// phases' spread in CPU it explains. Where a sleeping thread pays to be woken (a VM), an order's
/// CPU may follow its wake-ups more than its work: the slope is then what one wake-up costs the
/// machine, and the intercept what an order would cost without any.
fn report_wake_up_fit(report: &mut Report, phases: &[(f64, f64)]) {
    let n = phases.len() as f64;
    let (mean_x, mean_y) = (phases.iter().map(|p| p.0).sum::<f64>() / n, phases.iter().map(|p| p.1).sum::<f64>() / n);
    let spread: f64 = phases.iter().map(|(x, _)| (x - mean_x).powi(2)).sum();
    let slope = phases.iter().map(|(x, y)| (x - mean_x) * (y - mean_y)).sum::<f64>() / spread;
    let intercept = mean_y - slope * mean_x;
    let residual: f64 = phases.iter().map(|(x, y)| (y - intercept - slope * x).powi(2)).sum();
    let total: f64 = phases.iter().map(|(_, y)| (y - mean_y).powi(2)).sum();
    let note = format!("the fit of CPU per order to wake-ups per order over the {n} phases above");
    report.figure("wake-ups", "CPU per wake-up", slope * 1e6, "us", &note);
    report.figure("wake-ups", "CPU per order at no wake-ups", intercept * 1e6, "us/ord", "the same fit's intercept");
    report.figure("wake-ups", "share of CPU per order the fit explains", (1.0 - residual / total) * 100.0, "%", "R²");
}

/// A phase's verdict in a few words: how much completed, what the API refused, how the orders in
/// flight and the p99 moved.
fn describe(verdict: &open_loop::Verdict) -> String {
    let mut said = format!("{:.1} % completed", verdict.completed_share * 100.0);
    if verdict.refused > 0 || verdict.ended_otherwise > 0 {
        said += &format!(" ({} refused, {} ended otherwise)", verdict.refused, verdict.ended_otherwise);
    }
    said + &format!(
        ", in flight {:+.0} (at most {:.0}), p99 {:.0} -> {:.0} ms",
        verdict.growth, verdict.growth_bound, verdict.p99_first, verdict.p99_last
    )
}

/// The database name at the end of a Postgres URL.
fn db_name(url: &str) -> String {
    url.rsplit('/').next().unwrap_or_default().to_owned()
}

/// `vars` and then `extra`.
fn env_with<'a>(vars: &'a [(&'a str, String)], extra: &'a [(String, String)]) -> Vec<(&'a str, String)> {
    vars.iter().cloned().chain(extra.iter().map(|(name, value)| (name.as_str(), value.clone()))).collect()
}

impl Bench {
    /// Every service together: the same-run baseline, the defaults on hot SKUs (D) and on a wide
    /// catalog, M, latency at 25, 50 and 90 % of M, commit -> publish, memory, two of each.
    pub(super) async fn end_to_end(&mut self) -> EndToEnd {
        println!("\n== end to end: every service ==");
        let wide = Catalog::Wide(WIDE_CATALOG);
        sqlx::query(
            "insert into stock (sku, available) select unnest($1::text[]), 1000000000 on conflict (sku) do nothing",
        )
        .bind(Catalog::wide_skus(WIDE_CATALOG))
        .execute(&self.inventory)
        .await
        .expect("wide catalog");
        // The same-run baseline: every consumer as before batching, one message per transaction,
        // 16 at once (BATCH_SIZE=1 and the PREFETCH that was measured best for it).
        let before_batching = [("BATCH_SIZE", "1"), ("PREFETCH", "16")];
        let (api_addr, processes, _) =
            self.start_shop(&before_batching.map(|(n, v)| (n.to_owned(), v.to_owned())), 1).await;
        let (unbatched, cpu_unbatched, note) =
            self.sustained("BATCH_SIZE=1, PREFETCH=16", &api_addr, Catalog::Hot, &processes).await;
        self.report.figure("e2e", "sustained, one message per transaction (baseline)", unbatched, "/s", &note);
        cpu_unbatched.report(&mut self.report, "BATCH_SIZE=1");
        // Each phase's (wake-ups, CPU) per order, for the fit at the end.
        let mut phases = vec![cpu_unbatched.point()];
        for process in processes {
            stop(process).await;
        }

        // The shipped defaults (or what --service-var sets), four hot SKUs, then a wide catalog.
        let (api_addr, processes, _) = self.start_shop(&self.args.service_vars.clone(), 1).await;
        let (hot, cpu_hot, note) = self.sustained("defaults, 4 hot SKUs", &api_addr, Catalog::Hot, &processes).await;
        self.report.figure("e2e", "sustained throughput (POST -> succeeded)", hot, "/s", &note);
        cpu_hot.report(&mut self.report, "defaults, hot");
        // The wide catalog's prices (its stock was created above), in the database billing created.
        let billing = self.env.pool("billing").await;
        sqlx::query(
            "insert into prices (sku, unit_price_cents) select unnest($1::text[]), 100 on conflict (sku) do nothing",
        )
        .bind(Catalog::wide_skus(WIDE_CATALOG))
        .execute(&billing)
        .await
        .expect("wide catalog prices");
        let (wide_rate, cpu_wide, note) = self.sustained("defaults, wide catalog", &api_addr, wide, &processes).await;
        let report = &mut self.report;
        report.figure("e2e", &format!("sustained throughput, {WIDE_CATALOG} SKUs"), wide_rate, "/s", &note);
        cpu_wide.report(report, "defaults, wide");
        phases.extend([cpu_hot.point(), cpu_wide.point()]);
        report.figure("e2e", "sustained / baseline (BATCH_SIZE=1, PREFETCH=16)", hot / unbatched, "x", "same run");

        let capacity = match self.args.capacity {
            Some(given) => Some(given),
            None => self.capacity(hot, &api_addr).await,
        };
        let mut at_shares = Vec::new();
        if let Some(capacity) = capacity {
            // Every order of the search has ended (or M was given, after the drains): the shop
            // settles.
            let idle = self.idle(&processes, &billing).await;
            for share in self.args.loads.clone().unwrap_or_else(|| LOADS.to_vec()) {
                let (at, cost) =
                    self.latency_at(share, capacity, (&cpu_hot, &idle), &api_addr, &billing, &processes).await;
                at_shares.push(at);
                phases.push(cost.point());
            }
        }
        let commit_to_publish = self.commit_to_publish().await;
        let mut peak_rss = 0.0_f64;
        for process in &processes {
            let rss = process.peak_rss_kib().unwrap_or(0) as f64 / 1024.0;
            peak_rss = peak_rss.max(rss);
            self.report.figure(
                "memory",
                &format!("peak RSS {}", process.name()),
                rss,
                "MiB",
                "after the end-to-end load",
            );
        }
        for process in processes {
            stop(process).await;
        }

        // Two instances of every service, as a team scales out: the APIs behind one balancer, two
        // relays on the same outboxes, two consumers on each queue. On this machine both copies
        // share the same two cores with Postgres, RabbitMQ and the bench.
        let (api_addr, processes, balancer) = self.start_shop(&self.args.service_vars.clone(), 2).await;
        let (two, cpu_two, note) = self.sustained("two of each, 4 hot SKUs", &api_addr, Catalog::Hot, &processes).await;
        let note = format!("{note}; the APIs behind the bench's own TCP balancer");
        self.report.figure("e2e", "sustained, two instances of each service", two, "/s", &note);
        cpu_two.report(&mut self.report, "two of each, hot");
        let note =
            format!("machine {:.0} % busy with one, {:.0} % with two", cpu_hot.busy * 100.0, cpu_two.busy * 100.0);
        self.report.figure("e2e", "two instances / one", two / hot, "x", &note);
        phases.push(cpu_two.point());
        report_wake_up_fit(&mut self.report, &phases);
        drop(balancer);
        for process in processes {
            stop(process).await;
        }
        EndToEnd {
            cpu: cpu_hot.cpu,
            cpu_unbatched: cpu_unbatched.cpu,
            drain: hot,
            capacity,
            at_shares,
            commit_to_publish,
            peak_rss,
        }
    }

    /// `instances` of each of the four services, with `extra` variables; where orders go (the API,
    /// or the balancer in front of the APIs when there are several) and the balancer.
    async fn start_shop(
        &self,
        extra: &[(String, String)],
        instances: usize,
    ) -> (String, Vec<Process>, Option<Balancer>) {
        let billing_url = self.env.database_url("billing");
        let all = format!("{},{},{billing_url}", self.orders_url, self.inventory_url);
        let log_dir = &self.log_dir;
        let services = [
            (Service::Api, self.orders_url.clone()),
            (Service::Inventory, self.inventory_url.clone()),
            (Service::Billing, billing_url),
            (Service::Relay, all),
        ];
        let mut processes = Vec::new();
        let mut apis = Vec::new();
        for (service, url) in &services {
            for index in 0..instances {
                let name = Instance { service: *service, index }.to_string();
                let vars = self.service_vars(url);
                let (process, addr) = start_as(&name, service.binary(), &env_with(&vars, extra), log_dir).await;
                if *service == Service::Api {
                    apis.push(addr);
                }
                processes.push(process);
            }
        }
        if instances == 1 {
            return (apis.remove(0), processes, None);
        }
        let balancer = Balancer::start(apis).await.expect("the APIs' balancer");
        (balancer.addr().to_string(), processes, Some(balancer))
    }

    /// Sustained maximum: offer as fast as the API answers, until every order has succeeded; with
    /// each process's and each server's CPU seconds per order over the phase.
    async fn sustained(
        &self,
        label: &str,
        api_addr: &str,
        catalog: Catalog,
        processes: &[Process],
    ) -> (f64, PhaseCost, String) {
        let (orders, c) = (&self.orders, self.args.concurrency);
        let meter = self.meter(processes).await;
        let (_, jobs) = stages::post_orders(api_addr, c, self.args.orders, catalog).await;
        stages::wait_succeeded(orders, &jobs).await;
        let cost = meter.finish(self, jobs.len()).await;
        let (rate,): (f64,) = sqlx::query_as(
            "select count(*) / extract(epoch from max(updated_at) - min(created_at))::float8 from jobs where id = any($1)",
        )
        .bind(&jobs)
        .fetch_one(orders)
        .await
        .expect("sustained");
        (rate, cost, format!("{} orders, concurrency {c}, {label}", self.args.orders))
    }

    /// Start measuring what a phase costs `processes` and the servers.
    async fn meter(&self, processes: &[Process]) -> Meter {
        let pids: Vec<(String, u32)> = processes.iter().filter_map(|p| Some((p.name().to_owned(), p.pid()?))).collect();
        let counts = stages::database_counts(&self.orders, &self.databases()).await;
        // After `database_counts`, which waits for the statistics to settle.
        let each = pids.iter().map(|(_, pid)| stages::cpu_seconds(*pid)).collect();
        let wake_ups = wake_ups(&pids).into_iter().map(|(_, count)| count).collect();
        let io_wake_ups = io_wake_ups(&pids);
        let window = Usage::start(&pids.iter().map(|(_, pid)| *pid).collect::<Vec<_>>());
        Meter { pids, each, wake_ups, io_wake_ups, window, counts }
    }

    /// The names of the three services' databases.
    fn databases(&self) -> Vec<String> {
        ["orders", "inventory", "billing"].iter().map(|service| db_name(&self.env.database_url(service))).collect()
    }

    /// A paced phase at `rate` orders/s, shaped by the arguments; `seed` picks its Poisson
    /// schedule.
    fn phase(&self, rate: f64, seed: u64) -> Phase {
        Phase {
            rate,
            arrivals: self.args.arrivals,
            warm_up: Duration::from_secs(self.args.warm_up_secs),
            window: Duration::from_secs(self.args.window_secs),
            seed,
        }
    }

    /// Offer a paced phase of hot-SKU orders and wait for them to end: what it offered and how its
    /// orders ended.
    async fn paced(&self, phase: Phase, api_addr: &str) -> (Offered, Ends) {
        let offered = open_loop::offer(api_addr, Catalog::Hot, phase, &self.orders).await;
        let ends = open_loop::ends(&self.orders, &offered.jobs()).await;
        (offered, ends)
    }

    /// M: the highest open-loop paced rate the shop sustains ([`Offered::verdict`]), searched
    /// for from 0.3 × `drain` (D) up by ×1.25 until a step fails, then by bisection to within 10 %
    /// ([`Search`]). Each step is reported with what failed, if anything. `None` if no rate was
    /// sustained, or if a step's orders had not all ended [`open_loop::END_WAIT`] after it: the
    /// shop is then not fit to measure latency on.
    async fn capacity(&mut self, drain: f64, api_addr: &str) -> Option<f64> {
        println!("\n== capacity: the highest paced rate sustained (M), from 0.3 D ==");
        let mut search = Search::new(SEARCH_FROM * drain);
        let mut seed = 0;
        while let Some(rate) = search.next_rate() {
            seed += 1;
            let (offered, ends) = self.paced(self.phase(rate, seed), api_addr).await;
            let verdict = offered.verdict(&ends);
            search.record(rate, verdict.sustained());
            let outcome = if verdict.sustained() { "sustained".to_owned() } else { verdict.failures.join("; ") };
            let note = format!("{outcome}; {}", describe(&verdict));
            self.report.figure("capacity", &format!("step at {:.2} D", rate / drain), rate, "/s", &note);
            if !ends.all(&offered.jobs()) {
                println!(
                    "  capacity: not measured, a step's orders had not all ended {:?} after it",
                    open_loop::END_WAIT
                );
                return None;
            }
        }
        let arrivals = format!("{:?} arrivals", self.args.arrivals).to_lowercase();
        let note =
            format!("open loop, {arrivals}, {} s windows after {} s", self.args.window_secs, self.args.warm_up_secs);
        let Some(capacity) = search.capacity() else {
            let lowest = search.lowest_failed().unwrap_or(f64::NAN);
            println!("  capacity: no rate was sustained, down to {lowest:.0}/s");
            return None;
        };
        self.report.figure("capacity", "M, the highest paced rate sustained", capacity, "/s", &note);
        let failed = search.lowest_failed().map_or("none failed".to_owned(), |rate| format!("{rate:.0}/s failed"));
        self.report.figure("capacity", "M / D", capacity / drain, "x", &format!("D: the drain, above; {failed}"));
        Some(capacity)
    }

    /// POST -> succeeded at `share` × `capacity` (M), open loop, each quantile the median of
    /// [`REPEATS`] windows; where the time goes between the steps; and what an order cost
    /// meanwhile, against `drain`, what an order cost in the drain (phase 2).
    async fn latency_at(
        &mut self,
        share: f64,
        capacity: f64,
        (drain, idle): (&PhaseCost, &Idle),
        api_addr: &str,
        billing: &PgPool,
        processes: &[Process],
    ) -> (AtShare, PhaseCost) {
        let rate = share * capacity;
        let meter = self.meter(processes).await;
        let started = Instant::now();
        let (mut repeats, mut window, mut accepted) = (Vec::new(), Vec::new(), 0);
        for repeat in 0..REPEATS {
            let (offered, ends) = self.paced(self.phase(rate, 100 + repeat), api_addr).await;
            accepted += offered.jobs().len();
            window.extend(offered.in_window().filter_map(|order| Some((order.job?, order.due))));
            repeats.push(offered.verdict(&ends));
        }
        let elapsed = started.elapsed().as_secs_f64();
        let cost = meter.finish(self, accepted).await;
        let latency = Latency::median(&repeats.iter().map(|verdict| verdict.latency).collect::<Vec<_>>());
        let at = format!("at {:.0} % of M", share * 100.0);
        let arrivals = format!("{:?}", self.args.arrivals).to_lowercase();
        let note = format!("offered {rate:.0}/s, {arrivals}; median of {REPEATS} windows");
        let report = &mut self.report;
        let quantiles = [("p50", latency.p50), ("p99", latency.p99), ("p99.9", latency.p999), ("max", latency.max)];
        for (quantile, value) in quantiles {
            report.figure("e2e", &format!("POST -> succeeded {quantile} {at}"), value, "ms", &note);
        }
        for (repeat, verdict) in repeats.iter().enumerate() {
            let held = if verdict.sustained() { "sustained" } else { "not sustained" };
            let note = format!("{held}; {}", describe(verdict));
            report.figure("e2e", &format!("  window {} {at}: p99", repeat + 1), verdict.latency.p99, "ms", &note);
        }
        let note = format!("{}; machine {:.0} % busy", cost.cpu.split("services"), cost.busy * 100.0);
        report.figure("e2e", &format!("  CPU per order {at}"), cost.cpu.total() * 1e6, "us/ord", &note);
        let ((wake_ups, cpu), (drain_wake_ups, drain_cpu)) = (cost.point(), drain.point());
        report.figure("e2e", &format!("  CPU per order {at} / the drain's"), cpu / drain_cpu, "x", "");
        let note = "every process's, services and servers";
        report.figure("e2e", &format!("  wake-ups per order {at} / the drain's"), wake_ups / drain_wake_ups, "x", note);
        // Over the whole phase (warm-ups and the waits for the orders' ends included), as the CPU
        // per order is.
        let paid = idle.cpu_per_second * elapsed / accepted as f64;
        let note = format!(
            "the idle shop's {:.0} ms of CPU a second, {elapsed:.0} s, {accepted} orders",
            idle.cpu_per_second * 1e3
        );
        let idle_share = paid / cpu * 100.0;
        report.figure("e2e", &format!("  of the CPU per order {at}, the idle shop's"), idle_share, "%", &note);
        cost.report(report, &at);
        // Where the time goes: each span between two steps, over the windows' orders.
        let steps = stages::order_steps(&self.orders, &self.inventory, billing, &window).await;
        let mut spans: Vec<_> = SPANS.iter().map(|_| open_loop::histogram()).collect();
        for (due, times) in &steps {
            let mut from = Some(*due);
            for (span, to) in spans.iter_mut().zip(times) {
                if let (Some(from), Some(to)) = (from, to) {
                    open_loop::record(span, from, *to);
                }
                from = *to;
            }
        }
        for (name, span) in SPANS.iter().zip(&spans) {
            let Latency { p50, p99, .. } = Latency::of(span);
            report.figure("e2e", &format!("  {name}, p50"), p50, "ms", "");
            report.figure("e2e", &format!("  {name}, p99"), p99, "ms", "");
        }
        (AtShare { share, latency, cpu }, cost)
    }

    /// What the shop costs a second with no order in flight, watched for [`IDLE_WINDOW`] after
    /// the last order's trail has settled: its timers, probes, heartbeats and polls, and the
    /// servers' own. At a paced rate r, an order pays idle / r of it whatever the orders do.
    async fn idle(&mut self, processes: &[Process], billing: &PgPool) -> Idle {
        // The last phase's orders have succeeded, but their trail (`order.ended`, inventory's
        // settlement) may still run: wait until every outbox has published what
        // is due, then a little for the last deliveries to be applied.
        let unpublished =
            "select count(*) from outbox where published_at is null and parked_at is null and not scheduled";
        for pool in [&self.orders, &self.inventory, billing] {
            stages::wait_count(pool, unpublished, 0, Duration::from_secs(120)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        let meter = self.meter(processes).await;
        tokio::time::sleep(IDLE_WINDOW).await;
        // Per second, in the per-order figures' place.
        let cost = meter.finish(self, IDLE_WINDOW.as_secs() as usize).await;
        let (wake_ups, cpu_per_second) = cost.point();
        let report = &mut self.report;
        let note = format!("{}; machine {:.0} % busy", cost.cpu.split("services"), cost.busy * 100.0);
        report.figure("e2e", "idle shop: CPU per second", cpu_per_second * 1e6, "us/s", &note);
        for (name, seconds) in &cost.services {
            report.figure("cpu", &format!("idle shop: {name}"), seconds * 1e6, "us/s", "CPU time per second");
        }
        for (name, count) in &cost.wake_ups {
            report.figure("wake-ups", &format!("idle shop: {name}"), *count, "/s", "wake-ups per second");
        }
        report.figure("e2e", "idle shop: wake-ups per second", wake_ups, "/s", "every process's");
        Idle { cpu_per_second }
    }

    /// Commit -> publish with the relay idle on NOTIFY: p50 and p99, ms.
    async fn commit_to_publish(&mut self) -> (f64, f64) {
        let pings = stages::commit_to_publish(&self.orders, &self.amqp, 300, Duration::from_millis(10)).await;
        let (p50, _, p99) = percentiles(&pings);
        self.report.figure("e2e", "commit -> publish p50 (relay idle on NOTIFY)", p50, "ms", "300 rows, 10 ms apart");
        self.report.figure("e2e", "commit -> publish p99", p99, "ms", "");
        (p50, p99)
    }
}
