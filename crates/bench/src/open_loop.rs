//! Open-loop load, as wrk2 and the OpenMessaging Benchmark offer it: every order is sent at its
//! scheduled time whatever the orders before it are doing, and its latency counts from that time,
//! not from when a connection came free, so a slow answer cannot hide the orders queued behind it
//! (coordinated omission). Then what a phase shows: whether the shop sustained its rate, and its
//! latency in an HDR histogram. And the search for M, the highest paced rate the shop sustains.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use hdrhistogram::Histogram;
use messaging::runtime::http;
use sqlx::PgPool;
use tokio::{sync::Semaphore, task::JoinSet};
use uuid::Uuid;

use crate::limits::{Catalog, sample_order};

/// How a paced phase's orders arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Arrivals {
    /// Evenly spaced, 1/rate apart.
    Even,
    /// A Poisson process: gaps drawn from the exponential distribution of mean 1/rate, from a
    /// fixed seed, so that two runs offer the same schedule.
    Poisson,
}

/// The times, from a phase's start, at which its orders are due: `rate` a second for `length`.
pub fn schedule(arrivals: Arrivals, rate: f64, length: Duration, seed: u64) -> Vec<Duration> {
    let end = length.as_secs_f64();
    let due: Vec<f64> = match arrivals {
        // The k-th at k / rate, not by adding gaps, whose rounding would add up.
        Arrivals::Even => (1..).map(|k| f64::from(k) / rate).take_while(|at| *at < end).collect(),
        Arrivals::Poisson => {
            let mut random = fastrand::Rng::with_seed(seed);
            // 1 - U lies in (0, 1], so its logarithm is finite.
            std::iter::successors(Some(0.0), |at| Some(at - (1.0 - random.f64()).ln() / rate))
                .skip(1)
                .take_while(|at| *at < end)
                .collect()
        }
    };
    due.into_iter().map(Duration::from_secs_f64).collect()
}

/// A paced phase: its rate, how its orders arrive, and its two parts: a warm-up, whose orders
/// count for nothing, then the measured window.
#[derive(Debug, Clone, Copy)]
pub struct Phase {
    /// Orders offered a second.
    pub rate: f64,
    /// How they arrive.
    pub arrivals: Arrivals,
    /// Orders offered before the window, which count for nothing.
    pub warm_up: Duration,
    /// The measured window.
    pub window: Duration,
    /// The seed of a Poisson schedule.
    pub seed: u64,
}

/// How long after a window's end its orders may still end and count as completed: an order
/// offered in the window's last instant has this long to pass every hop.
pub const ALLOWANCE: Duration = Duration::from_secs(10);

/// How long the orders of a phase have, after its last request was answered, to end at all: past
/// this the shop is not keeping up, and the next phase would start on its backlog.
pub const END_WAIT: Duration = Duration::from_secs(180);

/// The longest the load waits for one answer: a request unanswered by then has failed.
const ANSWER_WAIT: Duration = Duration::from_secs(60);

/// How often the orders in flight are counted through the window.
const SAMPLE: Duration = Duration::from_millis(500);

/// The most connections the load opens to the API at once. Open-loop load opens one for every
/// request still unanswered when the next is due; past this, a request waits for one (its latency
/// still counts from when it was due).
const MAX_CONNECTIONS: usize = 512;

/// The job states in which an order has ended (`JobState::FINAL`).
const ENDED: [&str; 4] = ["succeeded", "rejected", "declined", "cancelled"];

/// An order a phase offered.
#[derive(Debug, Clone, Copy)]
pub struct Offer {
    /// When it was due, by the wall clock, which the databases' timestamps share.
    pub due: SystemTime,
    /// Seconds from the window's start to when it was due: negative in the warm-up.
    pub into_window: f64,
    /// Its job, if the API accepted it.
    pub job: Option<Uuid>,
}

/// What a phase offered.
pub struct Offered {
    /// The phase offered.
    pub phase: Phase,
    /// Every order, in the order they were due.
    pub orders: Vec<Offer>,
    /// Orders in flight (due and not yet answered, or accepted and not yet ended), counted every
    /// [`SAMPLE`] through the window: (seconds into the window, count).
    pub in_flight: Vec<(f64, usize)>,
    /// When the window ended, by the wall clock.
    pub window_end: SystemTime,
    /// How far the wall clock moved against the monotonic one over the phase: beyond
    /// [`CLOCK_MOVED`], the machine was paused or its clock stepped, and the phase measured that.
    pub clock_moved: Duration,
}

/// Offer `phase` to the API at `api` (host:port), orders of `catalog`; the orders in flight are
/// counted in `orders_db` through the window. Returns once every request has been answered.
pub async fn offer(api: &str, catalog: Catalog, phase: Phase, orders_db: &PgPool) -> Offered {
    let due = Arc::new(schedule(phase.arrivals, phase.rate, phase.warm_up + phase.window, phase.seed));
    let url = format!("http://{api}");
    let idle: Arc<Idle> = Arc::default();
    let connections = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let answers: Arc<Mutex<Answers>> = Arc::default();
    // The start, by both clocks: the monotonic one paces, the wall clock is what the databases'
    // timestamps are compared with.
    let lead = Duration::from_millis(50);
    let (start, start_wall) = (Instant::now() + lead, SystemTime::now() + lead);
    let counter = InFlight { due: Arc::clone(&due), start, answers: Arc::clone(&answers) };
    let sampler = tokio::spawn(counter.count(orders_db.clone(), phase.warm_up, phase.window));
    let mut requests = JoinSet::new();
    // Each order's due time by the wall clock, read when it is sent: a wall clock stepped or slewed
    // against the monotonic one meanwhile (a VM paused or restored) then shifts no order's latency
    // but those in flight across the step, which `clock_moved` reports.
    let mut due_wall = Vec::with_capacity(due.len());
    for (index, at) in due.iter().enumerate() {
        tokio::time::sleep_until((start + *at).into()).await;
        due_wall.push(wall_at(start + *at));
        let (url, idle, connections, answers) =
            (url.clone(), Arc::clone(&idle), Arc::clone(&connections), Arc::clone(&answers));
        requests.spawn(async move {
            let posted = tokio::time::timeout(ANSWER_WAIT, post(&url, &idle, &connections, index, catalog));
            let job = posted.await.ok().flatten();
            answers.lock().expect("answers").answered(job);
            (index, job)
        });
    }
    let mut jobs = vec![None; due.len()];
    while let Some(joined) = requests.join_next().await {
        let (index, job) = joined.expect("a request's task");
        jobs[index] = job;
    }
    let in_flight = sampler.await.expect("the in-flight counter");
    let window_start_secs = phase.warm_up.as_secs_f64();
    let orders = due
        .iter()
        .zip(due_wall)
        .zip(jobs)
        .map(|((at, due), job)| Offer { due, into_window: at.as_secs_f64() - window_start_secs, job })
        .collect();
    let wall_elapsed = SystemTime::now().duration_since(start_wall).unwrap_or_default();
    let clock_moved = wall_elapsed.abs_diff(start.elapsed());
    let window_end = wall_at(start + phase.warm_up + phase.window);
    Offered { phase, orders, in_flight, window_end, clock_moved }
}

/// `instant`, past, by the wall clock as it reads now.
/// `Bearer <an operator's token>`, signed once per run: it may order in any customer's name, and
/// its check (an HMAC) is part of what the API's latency measures, as in production.
pub fn operator() -> &'static str {
    static OPERATOR: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    OPERATOR.get_or_init(|| testkit::auth::bearer(&testkit::auth::operator()))
}

fn wall_at(instant: Instant) -> SystemTime {
    SystemTime::now() - instant.elapsed()
}

/// POST order `index` of `catalog`, on an idle connection or a new one; its job if accepted.
async fn post(url: &str, idle: &Idle, connections: &Semaphore, index: usize, catalog: Catalog) -> Option<Uuid> {
    let _permit = connections.acquire().await.ok()?;
    let mut connection = match idle.take() {
        Some(connection) => connection,
        None => http::Connection::open(url).await.ok()?,
    };
    let body = serde_json::to_string(&sample_order(index, catalog)).expect("json");
    let headers = [("Authorization", operator())];
    let response = connection.send("POST", "/orders", &headers, Some(body.as_bytes())).await.ok()?;
    idle.put(connection);
    (response.status == 202).then(|| crate::stages::job_id(&response.body))
}

/// How long a keep-alive connection may sit idle before the load stops using it: under the API's
/// header timeout (10 s), after which the API closes a connection that has sent no request, and
/// the next request on it would fail. (HTTP clients keep such an idle timeout for the same
/// reason; the first run of this load, without one, counted 1 to 9 orders a window as refused.)
const IDLE_FOR: Duration = Duration::from_secs(5);

/// The load's idle connections, each with when it was last used.
#[derive(Default)]
struct Idle(Mutex<Vec<(http::Connection, Instant)>>);

impl Idle {
    /// The most recently used connection idle for less than [`IDLE_FOR`]; older ones are dropped.
    fn take(&self) -> Option<http::Connection> {
        let mut idle = self.0.lock().expect("idle connections");
        idle.retain(|(_, since)| since.elapsed() < IDLE_FOR);
        idle.pop().map(|(connection, _)| connection)
    }

    fn put(&self, connection: http::Connection) {
        self.0.lock().expect("idle connections").push((connection, Instant::now()));
    }
}

/// The answers so far, as the in-flight counter reads them: under one lock, so that an answer is
/// counted either as unanswered or as accepted, never both nor neither.
#[derive(Default)]
struct Answers {
    /// Requests answered (or given up on).
    answered: usize,
    /// Jobs accepted since the counter last looked.
    accepted: Vec<Uuid>,
}

impl Answers {
    fn answered(&mut self, job: Option<Uuid>) {
        self.answered += 1;
        self.accepted.extend(job);
    }
}

/// Counts a phase's orders in flight.
struct InFlight {
    /// The phase's schedule, from `start`.
    due: Arc<Vec<Duration>>,
    start: Instant,
    answers: Arc<Mutex<Answers>>,
}

impl InFlight {
    /// Every [`SAMPLE`] through the window (`window` after `warm_up`): the orders in flight, those
    /// due and not yet answered (whether or not the load has managed to send them: a load that
    /// falls behind hides no backlog) plus those accepted and not yet ended. Each look asks only
    /// about the jobs not yet seen ended.
    async fn count(self, db: PgPool, warm_up: Duration, window: Duration) -> Vec<(f64, usize)> {
        let from = self.start + warm_up;
        let mut pending: Vec<Uuid> = Vec::new();
        let mut samples = Vec::new();
        let mut ticks = tokio::time::interval_at(from.into(), SAMPLE);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let now = ticks.tick().await.into_std();
            let at = now.duration_since(from).as_secs_f64();
            if at > window.as_secs_f64() {
                return samples;
            }
            let due = self.due.partition_point(|due| self.start + *due <= now);
            let unanswered = {
                let mut answers = self.answers.lock().expect("answers");
                pending.append(&mut answers.accepted);
                due.saturating_sub(answers.answered)
            };
            let ended: HashSet<Uuid> = sqlx::query_scalar("select id from jobs where id = any($1) and state = any($2)")
                .bind(&pending)
                .bind(ENDED)
                .fetch_all(&db)
                .await
                .expect("ended jobs")
                .into_iter()
                .collect();
            pending.retain(|job| !ended.contains(job));
            samples.push((at, pending.len() + unanswered));
        }
    }
}

/// How each of a phase's jobs ended, and when the bench stopped waiting for the rest.
pub struct Ends {
    /// Each job that ended: when (its `updated_at` once in an ended state), and whether it
    /// succeeded.
    pub ended: HashMap<Uuid, (SystemTime, bool)>,
    /// When the bench stopped waiting: every job had ended, or [`END_WAIT`] had passed.
    pub gave_up: SystemTime,
}

/// Wait up to [`END_WAIT`] for every one of `jobs` to end.
pub async fn ends(db: &PgPool, jobs: &[Uuid]) -> Ends {
    let deadline = Instant::now() + END_WAIT;
    let mut ended = HashMap::with_capacity(jobs.len());
    let mut waiting = jobs.to_vec();
    while !waiting.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now_ended: Vec<(Uuid, chrono::DateTime<chrono::Utc>, bool)> = sqlx::query_as(
            "select id, updated_at, state = 'succeeded' from jobs where id = any($1) and state = any($2)",
        )
        .bind(&waiting)
        .bind(ENDED)
        .fetch_all(db)
        .await
        .expect("ended jobs");
        for (job, at, succeeded) in now_ended {
            ended.insert(job, (SystemTime::from(at), succeeded));
        }
        waiting.retain(|job| !ended.contains_key(job));
    }
    Ends { ended, gave_up: SystemTime::now() }
}

impl Ends {
    /// Whether every one of `jobs` ended.
    pub fn all(&self, jobs: &[Uuid]) -> bool {
        jobs.iter().all(|job| self.ended.contains_key(job))
    }
}

/// Latency quantiles, ms.
#[derive(Debug, Clone, Copy, Default)]
pub struct Latency {
    /// The median.
    pub p50: f64,
    /// The 99th percentile.
    pub p99: f64,
    /// The 99.9th percentile.
    pub p999: f64,
    /// The largest.
    pub max: f64,
}

impl Latency {
    /// The quantiles of `histogram` (microseconds); NaN if it is empty.
    pub fn of(histogram: &Histogram<u64>) -> Self {
        if histogram.is_empty() {
            return Self { p50: f64::NAN, p99: f64::NAN, p999: f64::NAN, max: f64::NAN };
        }
        let ms = |micros: u64| micros as f64 / 1000.0;
        Self {
            p50: ms(histogram.value_at_quantile(0.50)),
            p99: ms(histogram.value_at_quantile(0.99)),
            p999: ms(histogram.value_at_quantile(0.999)),
            max: ms(histogram.max()),
        }
    }

    /// Each quantile's median over `repeats` (of two, their mean).
    pub fn median(repeats: &[Self]) -> Self {
        let median = |quantile: fn(&Self) -> f64| {
            let mut values: Vec<f64> = repeats.iter().map(quantile).collect();
            values.sort_by(f64::total_cmp);
            match values.len() {
                0 => f64::NAN,
                n if n % 2 == 1 => values[n / 2],
                n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
            }
        };
        Self { p50: median(|l| l.p50), p99: median(|l| l.p99), p999: median(|l| l.p999), max: median(|l| l.max) }
    }
}

/// An empty histogram of microseconds, from 1 µs to an hour, to three significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("the histogram's bounds")
}

/// Record the span from `from` to `to` in `histogram`, in microseconds (a negative span, from the
/// databases' timestamps and the bench's clock rounding differently, as the least).
pub fn record(histogram: &mut Histogram<u64>, from: SystemTime, to: SystemTime) {
    let micros = to.duration_since(from).unwrap_or_default().as_micros();
    histogram.saturating_record(u64::try_from(micros).unwrap_or(u64::MAX).max(1));
}

/// Whether a phase sustained its rate, and what says so.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// The share of the window's orders that were accepted and succeeded within [`ALLOWANCE`] of
    /// its end.
    pub completed_share: f64,
    /// The window's orders the API did not accept (an error, an answer other than 202, or none
    /// within a minute), and those that ended otherwise than succeeded: each a defect of the run
    /// more than of the rate.
    pub refused: usize,
    pub ended_otherwise: usize,
    /// How much the orders in flight grew over the window, by the least-squares line through
    /// the samples.
    pub growth: f64,
    /// The most it may grow: half a second of arrivals, or 5 orders at the least (over a 30 s
    /// window, a backlog growing by 1.7 % of the rate or more fails).
    pub growth_bound: f64,
    /// POST -> ended p99 of the orders due in the window's first third and in its last, ms.
    pub p99_first: f64,
    /// See `p99_first`.
    pub p99_last: f64,
    /// The window's POST -> succeeded latency. An order that did not succeed counts as lasting
    /// until the bench stopped waiting, so that the slowest orders cannot drop out of the tail.
    pub latency: Latency,
    /// What failed, if anything.
    pub failures: Vec<String>,
}

impl Verdict {
    /// Whether the phase sustained its rate: nothing failed.
    pub fn sustained(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The least share of a window's orders that must complete.
const COMPLETE: f64 = 0.99;
/// The most the wall clock may move against the monotonic one over a phase. Once a full run's
/// latency phases (2026-12-05) saw a VM restored mid-run: the wall clock stepped 29 s, then drifted
/// 5 ms a second, and every order looked 128 ms late at p50.
const CLOCK_MOVED: Duration = Duration::from_millis(50);
/// The most the last third's p99 may be of the first third's.
const P99_GROWTH: f64 = 1.5;

impl Offered {
    /// The window's orders.
    pub fn in_window(&self) -> impl Iterator<Item = &Offer> {
        self.orders.iter().filter(|order| order.into_window >= 0.0)
    }

    /// Every accepted job, warm-up's included.
    pub fn jobs(&self) -> Vec<Uuid> {
        self.orders.iter().filter_map(|order| order.job).collect()
    }

    /// Judge the phase by how its orders ended: sustained if at least 99 % of the window's orders
    /// succeeded within [`ALLOWANCE`] of its end, the orders in flight show no upward trend, and
    /// the last third's p99 is at most 1.5 × the first third's.
    pub fn verdict(&self, ends: &Ends) -> Verdict {
        let window = self.phase.window.as_secs_f64();
        let last_counted = self.window_end + ALLOWANCE;
        let (mut all, mut first, mut last) = (histogram(), histogram(), histogram());
        let (mut offered, mut completed, mut refused, mut ended_otherwise) = (0_usize, 0_usize, 0_usize, 0_usize);
        for order in self.in_window() {
            offered += 1;
            let end = match order.job.map(|job| ends.ended.get(&job)) {
                None => {
                    refused += 1;
                    ends.gave_up
                }
                Some(Some((at, true))) => {
                    completed += usize::from(*at <= last_counted);
                    *at
                }
                Some(Some((_, false))) => {
                    ended_otherwise += 1;
                    ends.gave_up
                }
                Some(None) => ends.gave_up,
            };
            record(&mut all, order.due, end);
            if order.into_window < window / 3.0 {
                record(&mut first, order.due, end);
            } else if order.into_window >= window * 2.0 / 3.0 {
                record(&mut last, order.due, end);
            }
        }
        let completed_share = completed as f64 / offered.max(1) as f64;
        let growth = slope(&self.in_flight) * window;
        let growth_bound = (self.phase.rate * 0.5).max(5.0);
        let (p99_first, p99_last) = (Latency::of(&first).p99, Latency::of(&last).p99);
        let mut failures = Vec::new();
        if completed_share < COMPLETE {
            failures.push(format!("{:.1} % completed", completed_share * 100.0));
        }
        if growth > growth_bound {
            failures.push(format!("in flight grew by {growth:.0} (at most {growth_bound:.0})"));
        }
        // An empty third has a NaN p99, and fails the phase.
        let p99_grew = p99_first.is_nan() || p99_last.is_nan() || p99_last > p99_first * P99_GROWTH;
        if p99_grew {
            failures.push(format!("p99 {p99_first:.0} -> {p99_last:.0} ms from the first third to the last"));
        }
        if self.clock_moved > CLOCK_MOVED {
            let moved = self.clock_moved.as_millis();
            failures.push(format!(
                "the wall clock moved {moved} ms against the monotonic one: the machine paused or its clock stepped"
            ));
        }
        Verdict {
            completed_share,
            refused,
            ended_otherwise,
            growth,
            growth_bound,
            p99_first,
            p99_last,
            latency: Latency::of(&all),
            failures,
        }
    }
}

/// The slope of the least-squares line through `points`; 0 for fewer than two.
pub fn slope(points: &[(f64, usize)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mean_x = points.iter().map(|(x, _)| x).sum::<f64>() / n;
    let mean_y = points.iter().map(|(_, y)| *y as f64).sum::<f64>() / n;
    let spread: f64 = points.iter().map(|(x, _)| (x - mean_x).powi(2)).sum();
    if spread == 0.0 {
        return 0.0;
    }
    points.iter().map(|(x, y)| (x - mean_x) * (*y as f64 - mean_y)).sum::<f64>() / spread
}

/// The search for M: from a start, up by ×1.25 until a step fails, then bisecting (by the
/// geometric mean) until the highest rate sustained and the lowest not are within 10 % of each
/// other (±5 % around their middle). M is the lower end, the highest rate sustained: the rate
/// at which the shop stops keeping up lies between it and 10 % above. If the start fails, the
/// search steps down by ÷1.25 instead.
#[derive(Debug, Clone)]
pub struct Search {
    start: f64,
    sustained: Option<f64>,
    failed: Option<f64>,
    steps: usize,
}

/// Each step of the search up or down.
const STEP: f64 = 1.25;
/// The search ends when the bracket is this narrow.
const BRACKET: f64 = 1.10;
/// The most steps a search takes.
const MAX_STEPS: usize = 14;

impl Search {
    /// A search that starts at `start` orders/s.
    pub fn new(start: f64) -> Self {
        Self { start, sustained: None, failed: None, steps: 0 }
    }

    /// The next rate to try, or `None` once the search has ended.
    pub fn next_rate(&self) -> Option<f64> {
        if self.steps >= MAX_STEPS {
            return None;
        }
        match (self.sustained, self.failed) {
            (None, None) => Some(self.start),
            (Some(sustained), None) => Some(sustained * STEP),
            (None, Some(failed)) => Some(failed / STEP),
            (Some(sustained), Some(failed)) => (failed > sustained * BRACKET).then(|| (sustained * failed).sqrt()),
        }
    }

    /// What a step at `rate` showed.
    pub fn record(&mut self, rate: f64, sustained: bool) {
        self.steps += 1;
        if sustained {
            self.sustained = Some(self.sustained.map_or(rate, |best| best.max(rate)));
        } else {
            self.failed = Some(self.failed.map_or(rate, |least| least.min(rate)));
        }
    }

    /// M: the highest rate sustained so far.
    pub fn capacity(&self) -> Option<f64> {
        self.sustained
    }

    /// The lowest rate not sustained so far.
    pub fn lowest_failed(&self) -> Option<f64> {
        self.failed
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Arrivals, Ends, Offer, Offered, Phase, Search, schedule, slope};

    #[test]
    fn an_even_schedule_is_evenly_spaced_and_a_poisson_one_keeps_its_mean_rate() {
        let even = schedule(Arrivals::Even, 100.0, Duration::from_secs(10), 1);
        assert_eq!(even.len(), 999, "due at 10 ms, 20 ms, ... up to but not at 10 s");
        assert!(even.windows(2).all(|pair| ((pair[1] - pair[0]).as_secs_f64() - 0.01).abs() < 1e-9));

        let poisson = schedule(Arrivals::Poisson, 100.0, Duration::from_secs(100), 7);
        // 10,000 expected; a Poisson count's standard deviation is 100.
        assert!((9_600..=10_400).contains(&poisson.len()), "{}", poisson.len());
        let gaps: Vec<f64> = poisson.windows(2).map(|pair| (pair[1] - pair[0]).as_secs_f64()).collect();
        // Exponential gaps: about 1 - 1/e of them are shorter than the mean.
        let short = gaps.iter().filter(|gap| **gap < 0.01).count() as f64 / gaps.len() as f64;
        assert!((0.60..0.66).contains(&short), "{short}");
        assert_eq!(poisson, schedule(Arrivals::Poisson, 100.0, Duration::from_secs(100), 7), "seeded");
    }

    #[test]
    fn the_trend_is_the_least_squares_slope() {
        let flat: Vec<(f64, usize)> = (0..60).map(|i| (f64::from(i) * 0.5, 40 + (i % 3) as usize)).collect();
        assert!(slope(&flat).abs() < 0.1);
        let growing: Vec<(f64, usize)> = (0..60).map(|i| (f64::from(i) * 0.5, 40 + i as usize * 5)).collect();
        assert!((slope(&growing) - 10.0).abs() < 1e-9);
        assert_eq!(slope(&[(0.0, 3)]), 0.0);
    }

    #[test]
    fn the_search_steps_up_until_a_step_fails_then_bisects_to_within_ten_percent() {
        let capacity = 410.0;
        let mut search = Search::new(100.0);
        let mut tried = Vec::new();
        while let Some(rate) = search.next_rate() {
            tried.push(rate);
            search.record(rate, rate <= capacity);
        }
        let found = search.capacity().expect("found");
        assert!(found <= capacity && found * 1.10 > capacity, "{found} from {tried:?}");
        // 100, 125, 156, 195, 244, 305, 381, 477 (fails), then two bisections.
        assert_eq!(tried.len(), 10, "{tried:?}");
    }

    #[test]
    fn a_search_whose_start_fails_steps_down_and_one_that_finds_nothing_ends() {
        let mut search = Search::new(100.0);
        while let Some(rate) = search.next_rate() {
            search.record(rate, rate <= 70.0);
        }
        let found = search.capacity().expect("found");
        assert!(found <= 70.0 && found * 1.10 > 70.0, "{found}");

        let mut nothing = Search::new(100.0);
        while let Some(rate) = nothing.next_rate() {
            nothing.record(rate, false);
        }
        assert_eq!(nothing.capacity(), None);
    }

    /// A phase whose orders all succeeded 20 ms after they were due passes, unless the wall clock
    /// moved against the monotonic one meanwhile: then it measured the machine, not the shop.
    #[test]
    fn a_phase_passes_on_its_orders_unless_the_machine_s_clocks_moved_apart() {
        let phase = Phase {
            rate: 10.0,
            arrivals: Arrivals::Even,
            warm_up: Duration::ZERO,
            window: Duration::from_secs(30),
            seed: 1,
        };
        let start = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut ended = std::collections::HashMap::new();
        let orders: Vec<Offer> = (0..300_u32)
            .map(|i| {
                let into_window = f64::from(i) / 10.0;
                let due = start + Duration::from_secs_f64(into_window);
                let job = uuid::Uuid::from_u128(u128::from(i));
                ended.insert(job, (due + Duration::from_millis(20), true));
                Offer { due, into_window, job: Some(job) }
            })
            .collect();
        let in_flight = (0..60).map(|i| (f64::from(i) / 2.0, 2)).collect();
        let ends = Ends { ended, gave_up: start + Duration::from_secs(60) };
        let window_end = start + phase.window;
        let mut offered = Offered { phase, orders, in_flight, window_end, clock_moved: Duration::from_millis(3) };
        assert!(offered.verdict(&ends).sustained(), "{:?}", offered.verdict(&ends).failures);
        offered.clock_moved = Duration::from_secs(29);
        let verdict = offered.verdict(&ends);
        assert!(!verdict.sustained());
        assert_eq!(verdict.failures.len(), 1, "{:?}", verdict.failures);
    }
}
