//! Our stages, as the real (release) binaries run them, plus the naive relay baseline.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use lapin::{
    Connection,
    options::{BasicAckOptions, BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
};
use messaging::{publisher::Publisher, runtime::http};
use shop::exchanges;
use sqlx::{AssertSqlSafe, PgPool};
use testkit::process::{self, Process};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::{
    limits::{Catalog, sample_order},
    report::quantile,
};

/// A service process on a free port; `vars` on top of `RUST_LOG=info`.
pub async fn start(name: &str, vars: &[(&str, String)], log_dir: &Path) -> (Process, String) {
    start_as(name, name, vars, log_dir).await
}

/// [`start`] binary `binary` under the name `name` (its log's), for a second instance of a service.
pub async fn start_as(name: &str, binary: &str, vars: &[(&str, String)], log_dir: &Path) -> (Process, String) {
    let port = process::free_port();
    let mut env: Vec<(String, String)> =
        vec![("HTTP_ADDR".into(), format!("127.0.0.1:{port}")), ("RUST_LOG".into(), "info".into())];
    env.extend(vars.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let process = Process::spawn(name, process::binary(binary), env, log_dir);
    let base = format!("127.0.0.1:{port}");
    let note = format!("({name}; see {})", process.log_path().display());
    testkit::wait_ready(&format!("http://{base}"), Duration::from_secs(60), &note).await;
    (process, base)
}

/// SIGTERM and wait.
pub async fn stop(mut process: Process) {
    let status = process.terminate(Duration::from_secs(30)).await;
    assert!(matches!(status, Some(s) if s.success()), "{} did not stop cleanly: {status:?}", process.name());
}

/// How often the bench looks at a database while a stage runs. Every look is a statement on the
/// servers being measured, so not often: the rates come from the rows' own timestamps, not from
/// when the bench noticed the end.
const POLL: Duration = Duration::from_millis(100);

/// Poll `sql` (a count) on `pool` until it returns `want`.
pub async fn wait_count(pool: &PgPool, sql: &'static str, want: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        tokio::time::sleep(POLL).await;
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql);
        if n == want {
            return;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {sql} = {want} (it is {n})");
    }
}

/// Wait until every job in `ids` has succeeded. Each look asks only about the jobs not yet seen
/// succeeded (asking about all 3,000 of a phase took 18 ms a look under load).
pub async fn wait_succeeded(orders: &PgPool, ids: &[Uuid]) {
    let timeout = Duration::from_secs(600);
    let deadline = Instant::now() + timeout;
    let mut waiting = ids.to_vec();
    while !waiting.is_empty() {
        tokio::time::sleep(POLL).await;
        let done: HashSet<Uuid> = sqlx::query_scalar("select id from jobs where id = any($1) and state = 'succeeded'")
            .bind(&waiting)
            .fetch_all(orders)
            .await
            .expect("succeeded jobs")
            .into_iter()
            .collect();
        waiting.retain(|id| !done.contains(id));
        let left = waiting.len();
        assert!(Instant::now() < deadline, "timed out after {timeout:?}: {left} of {} orders not succeeded", ids.len());
    }
}

/// Mark every unpublished outbox row published: rows a stage left that no later stage wants.
pub async fn retire_unpublished(pool: &PgPool) {
    sqlx::query("update outbox set published_at = now() where published_at is null")
        .execute(pool)
        .await
        .expect("retire unpublished rows");
}

/// Rows per second between the first and the last `timestamp` of `table` matching `filter`,
/// excluding the first instant's own rows (a batch's rows share its timestamp): the rate a
/// stage achieved, from the database's own clock, whatever its start-up took.
pub async fn rate_from_timestamps(pool: &PgPool, table: &str, timestamp: &str, filter: &str) -> f64 {
    let sql = format!(
        "with t as (select {timestamp} as at from {table} where {filter})
         select count(*) filter (where at > (select min(at) from t)),
                extract(epoch from max(at) - min(at))::float8
         from t"
    );
    // Built from the bench's own names, never from input.
    let (after_first, seconds): (i64, Option<f64>) =
        sqlx::query_as(AssertSqlSafe(sql.as_str())).fetch_one(pool).await.expect(&sql);
    after_first as f64 / seconds.unwrap_or(f64::NAN)
}

/// POST `count` orders over `concurrency` keep-alive connections as fast as they are answered.
/// Returns orders per second and the accepted job ids.
pub async fn post_orders(api: &str, concurrency: usize, count: usize, catalog: Catalog) -> (f64, Vec<Uuid>) {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (api, next) = (api.to_owned(), Arc::clone(&next));
        tasks.spawn(async move {
            let mut connection = http::Connection::open(&format!("http://{api}")).await.expect("connect to the API");
            let mut jobs = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= count {
                    return jobs;
                }
                let body = serde_json::to_string(&sample_order(i, catalog)).expect("json");
                let headers = [("Authorization", crate::open_loop::operator())];
                let response =
                    connection.send("POST", "/orders", &headers, Some(body.as_bytes())).await.expect("POST /orders");
                assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
                jobs.push(job_id(&response.body));
            }
        });
    }
    let mut jobs = Vec::with_capacity(count);
    while let Some(joined) = tasks.join_next().await {
        jobs.extend(joined.expect("client task"));
    }
    (count as f64 / started.elapsed().as_secs_f64(), jobs)
}

/// The job id of a 202's body.
pub fn job_id(body: &[u8]) -> Uuid {
    let json: serde_json::Value = serde_json::from_slice(body).expect("202 body");
    json["jobId"].as_str().and_then(|id| id.parse().ok()).expect("jobId")
}

/// For each of `sent` (a job, and when its order was due) that has succeeded: when it was due,
/// and when it reached each step it passes (`None` where no row tells). The steps are read from
/// the databases' own timestamps, each a transaction's start (`now()`): the API's transaction,
/// then for each message the relay's claim (`published_at` is set in the transaction that claims,
/// publishes, awaits the confirm and marks) and the next consumer's transaction; the last is
/// `succeeded`, the status consumer's transaction for `invoice.created`.
pub async fn order_steps(
    orders: &PgPool,
    inventory: &PgPool,
    billing: &PgPool,
    sent: &[(Uuid, SystemTime)],
) -> Vec<(SystemTime, [Option<SystemTime>; 7])> {
    let ids: Vec<Uuid> = sent.iter().map(|(id, _)| *id).collect();
    type Times = (Uuid, DateTime<Utc>, Option<DateTime<Utc>>, DateTime<Utc>);
    let jobs: Vec<Times> = sqlx::query_as(
        "select id, created_at, published_at, updated_at from jobs where id = any($1) and state = 'succeeded'",
    )
    .bind(&ids)
    .fetch_all(orders)
    .await
    .expect("job times");
    let placed = hop(orders, "order.placed", Some(inventory), &ids).await;
    let reserved = hop(inventory, "inventory.reserved", Some(billing), &ids).await;
    // The status consumer's transaction is `succeeded` itself (`updated_at`, its `now()`).
    let invoiced = hop(billing, "invoice.created", None, &ids).await;
    let sent_at: HashMap<Uuid, SystemTime> = sent.iter().copied().collect();
    jobs.into_iter()
        .filter_map(|(job, created, published, succeeded)| {
            let sent = *sent_at.get(&job)?;
            let (placed, reserved, invoiced) =
                (placed.get(&job).copied(), reserved.get(&job).copied(), invoiced.get(&job).copied());
            let times = [
                Some(created),
                published,
                placed.and_then(|(_, received)| received),
                reserved.and_then(|(published, _)| published),
                reserved.and_then(|(_, received)| received),
                invoiced.and_then(|(published, _)| published),
                Some(succeeded),
            ];
            Some((sent, times.map(|at| at.map(SystemTime::from))))
        })
        .collect()
}

/// One hop's times, by job: for the message of `message_type` each of the jobs `ids` sent from
/// `sender`'s outbox, when the relay claimed it and when the `receiver`'s inbox took it (its
/// transaction's start).
type Hop = HashMap<Uuid, (Option<DateTime<Utc>>, Option<DateTime<Utc>>)>;

/// See [`Hop`].
async fn hop(sender: &PgPool, message_type: &'static str, receiver: Option<&PgPool>, ids: &[Uuid]) -> Hop {
    let messages: Vec<(Uuid, Uuid, Option<DateTime<Utc>>)> = sqlx::query_as(
        "select (headers ->> 'correlation_id')::uuid, message_id, published_at from outbox
          where message_type = $1 and (headers ->> 'correlation_id')::uuid = any($2)",
    )
    .bind(message_type)
    .bind(ids)
    .fetch_all(sender)
    .await
    .expect("sent messages");
    let message_ids: Vec<Uuid> = messages.iter().map(|(_, message, _)| *message).collect();
    let mut received: HashMap<Uuid, DateTime<Utc>> = HashMap::new();
    if let Some(receiver) = receiver {
        received = sqlx::query_as("select message_id, received_at from inbox where message_id = any($1)")
            .bind(&message_ids)
            .fetch_all(receiver)
            .await
            .expect("inbox times")
            .into_iter()
            .collect();
    }
    messages.into_iter().map(|(job, message, published)| (job, (published, received.get(&message).copied()))).collect()
}

/// The seeds' relay: one row at a time (claim, publish, await its confirm, mark, commit). Runs
/// until `count` rows are published or `limit` has passed; rows per second.
pub async fn naive_relay(pool: &PgPool, connection: &Connection, count: usize, limit: Duration) -> f64 {
    let publisher = Publisher::open(connection).await.expect("publisher");
    let started = Instant::now();
    let mut published = 0;
    while published < count && started.elapsed() < limit {
        let mut tx = pool.begin().await.expect("begin");
        let rows = messaging::outbox_relay::claim_unpublished(&mut tx, 1).await.expect("claim");
        let Some(row) = rows.first() else { break };
        publisher
            .publish(&row.exchange, &row.routing_key, row.payload.as_bytes(), row.properties())
            .await
            .expect("publish and confirm");
        messaging::outbox_relay::mark_published(&mut tx, &[row.id]).await.expect("mark");
        tx.commit().await.expect("commit");
        published += 1;
    }
    let rate = published as f64 / started.elapsed().as_secs_f64();
    publisher.close().await;
    rate
}

/// Commit -> publish latency with the relay idle on NOTIFY: commit one row at a time into the
/// outbox, `gap` apart, and time each until a consumer of its own queue receives it. Sorted ms.
pub async fn commit_to_publish(pool: &PgPool, connection: &Connection, samples: usize, gap: Duration) -> Vec<f64> {
    let channel = connection.create_channel().await.expect("channel");
    let queue = channel
        .queue_declare("".into(), QueueDeclareOptions { exclusive: true, ..Default::default() }, FieldTable::default())
        .await
        .expect("declare");
    let queue = queue.name().as_str().to_owned();
    channel
        .queue_bind(
            queue.as_str().into(),
            exchanges::ORDERS.into(),
            "bench.ping".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    let committed: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
    let mut deliveries = channel
        .basic_consume(queue.as_str().into(), "ping".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .expect("consume");
    let receiver = {
        let committed = Arc::clone(&committed);
        tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(samples);
            while latencies.len() < samples {
                let delivery = deliveries.next().await.expect("delivery").expect("delivery");
                let received = Instant::now();
                let id = messaging::envelope::message_id(&delivery.properties).expect("message id");
                delivery.ack(BasicAckOptions::default()).await.expect("ack");
                // The sender records the commit before the relay can have published it.
                let at = committed.lock().await.remove(&id).expect("committed row");
                latencies.push(received.duration_since(at).as_secs_f64() * 1000.0);
            }
            latencies
        })
    };
    for _ in 0..samples {
        let id = Uuid::now_v7();
        let mut tx = pool.begin().await.expect("begin");
        sqlx::query(
            "insert into outbox (message_id, message_type, exchange, routing_key, payload)
             values ($1, 'bench.ping', $2, 'bench.ping', '{}')",
        )
        .bind(id)
        .bind(exchanges::ORDERS)
        .execute(&mut *tx)
        .await
        .expect("insert");
        let mut guard = committed.lock().await;
        tx.commit().await.expect("commit");
        guard.insert(id, Instant::now());
        drop(guard);
        tokio::time::sleep(gap).await;
    }
    let mut latencies = receiver.await.expect("receiver");
    latencies.sort_by(f64::total_cmp);
    let _ = channel.close(200, "bye".into()).await;
    latencies
}

/// Copy one outbox row `count` times, unpublished (or published, for the scale test's history),
/// each with a fresh message id: a backlog in one statement.
pub async fn fill_outbox(pool: &PgPool, template: i64, count: i64, published: bool) {
    sqlx::query(
        "insert into outbox (message_id, message_type, exchange, routing_key, payload, headers, published_at)
         select gen_random_uuid(), message_type, exchange, routing_key, payload, headers,
                case when $1 then now() - interval '1 day' end
         from outbox, generate_series(1, $2)
         where id = $3",
    )
    .bind(published)
    .bind(count)
    .bind(template)
    .execute(pool)
    .await
    .expect("fill outbox");
}

/// Quantiles of sorted samples: (p50, p95, p99).
pub fn percentiles(sorted: &[f64]) -> (f64, f64, f64) {
    (quantile(sorted, 0.50), quantile(sorted, 0.95), quantile(sorted, 0.99))
}

/// CPU time (user + system) a process has used so far, in seconds, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> f64 {
    stat_seconds(pid, &[UTIME, STIME])
}

/// Fields of `/proc/<pid>/stat` counted from the one after the command name (which may hold
/// spaces): the 14th to 17th of the line, in clock ticks. The process's own user and system time,
/// then those of its children that have exited and been waited for.
const UTIME: usize = 11;
const STIME: usize = 12;
const CUTIME: usize = 13;
const CSTIME: usize = 14;

/// The sum of the given `/proc/<pid>/stat` tick fields, in seconds (100 ticks a second on Linux).
fn stat_seconds(pid: u32, fields: &[usize]) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let values: Vec<&str> = after.split_whitespace().collect();
    let ticks = |index: usize| values.get(index).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    fields.iter().map(|field| ticks(*field)).sum::<u64>() as f64 / 100.0
}

/// CPU seconds used so far by every process whose command is `comm` (e.g. `postgres`,
/// `beam.smp`), the servers' share, which their other clients on this machine add to; with the
/// processes that have exited. Postgres forks a backend per connection and reaps it when it ends,
/// and a reaped child's time is kept in its parent's `cutime` and `cstime`. Summed over the live
/// processes alone, a backend ending inside a window took all the CPU it had ever used out of
/// that window's figure: the floor's (c) showed Postgres at -158 µs a message in a run where the
/// connection of the relay's floor (20,000 rows claimed, marked and unmarked) closed just before.
pub fn cpu_seconds_of(comm: &str) -> f64 {
    pids_of(comm).map(|pid| stat_seconds(pid, &[UTIME, STIME, CUTIME, CSTIME])).sum()
}

/// Times a process's threads have gone to sleep and been woken so far (the sum over
/// `/proc/<pid>/task/*/status` of `voluntary_ctxt_switches`): each is a wake-up, which on a VM
/// costs system time of its own. Threads that have exited are not counted.
pub fn wake_ups(pid: u32) -> u64 {
    thread_wake_ups(pid, |_| true)
}

/// The name lapin gives the thread that reads and writes each of its connections (one per
/// connection): every frame a service sends or receives crosses between it and tokio's workers.
pub const LAPIN_IO_THREAD: &str = "lapin-io-loop";

/// [`wake_ups`] of those of a process's threads whose name (`/proc/<pid>/task/<tid>/comm`, at most
/// 15 bytes) `thread` accepts.
pub fn thread_wake_ups(pid: u32, thread: impl Fn(&str) -> bool) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .filter_map(|task| Some(task.ok()?.path()))
        .filter(|task| std::fs::read_to_string(task.join("comm")).is_ok_and(|name| thread(name.trim())))
        .filter_map(|task| std::fs::read_to_string(task.join("status")).ok())
        .filter_map(|status| {
            status.lines().find_map(|line| line.strip_prefix("voluntary_ctxt_switches:")?.trim().parse::<u64>().ok())
        })
        .sum()
}

/// [`wake_ups`] of every process whose command is `comm`.
pub fn wake_ups_of(comm: &str) -> u64 {
    pids_of(comm).map(wake_ups).sum()
}

/// Every process whose command is `comm`.
fn pids_of(comm: &str) -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(move |pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|name| name.trim() == comm))
}

/// CPU seconds, split as an order's cost is compared: the measured work's own processes (the
/// services, or the bench's client code for a limit), and the servers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Cpu {
    /// The processes of the work itself.
    pub own: f64,
    /// Every `postgres` process.
    pub postgres: f64,
    /// Every `beam.smp` process.
    pub rabbitmq: f64,
}

impl Cpu {
    /// Used so far by `pids` and the servers.
    fn so_far(pids: &[u32]) -> Self {
        Self {
            own: pids.iter().map(|pid| cpu_seconds(*pid)).sum(),
            postgres: cpu_seconds_of("postgres"),
            rabbitmq: cpu_seconds_of("beam.smp"),
        }
    }

    /// All three together.
    pub fn total(&self) -> f64 {
        self.own + self.postgres + self.rabbitmq
    }

    /// Each part divided by `n` (per message, per order).
    pub fn per(&self, n: f64) -> Self {
        *self * (1.0 / n)
    }

    /// The three parts in microseconds, the first called `own` (e.g. "services").
    pub fn split(&self, own: &str) -> String {
        format!(
            "{own} {:.0}, postgres {:.0}, rabbitmq {:.0} us",
            self.own * 1e6,
            self.postgres * 1e6,
            self.rabbitmq * 1e6
        )
    }
}

impl std::ops::Add for Cpu {
    type Output = Self;
    fn add(self, other: Self) -> Self {
        Self {
            own: self.own + other.own,
            postgres: self.postgres + other.postgres,
            rabbitmq: self.rabbitmq + other.rabbitmq,
        }
    }
}

impl std::ops::Sub for Cpu {
    type Output = Self;
    fn sub(self, other: Self) -> Self {
        self + other * -1.0
    }
}

impl std::ops::Mul<f64> for Cpu {
    type Output = Self;
    fn mul(self, factor: f64) -> Self {
        Self { own: self.own * factor, postgres: self.postgres * factor, rabbitmq: self.rabbitmq * factor }
    }
}

/// The CPU a stage uses over a window: its own processes', and the servers' (every `postgres` and
/// `beam.smp` process), in seconds; and how busy the whole machine was.
pub struct Usage {
    pids: Vec<u32>,
    cpu: Cpu,
    machine: Busy,
}

/// What a [`Usage`] window came to.
#[derive(Debug, Clone, Copy, Default)]
pub struct Used {
    /// CPU seconds of the processes and of the servers.
    pub cpu: Cpu,
    /// See [`Busy::finish`].
    pub busy: f64,
}

impl Usage {
    /// Open a window over `pids` and the servers.
    pub fn start(pids: &[u32]) -> Self {
        let pids = pids.to_vec();
        Self { cpu: Cpu::so_far(&pids), pids, machine: Busy::start() }
    }

    /// Open a window over the bench's own process (the client of a limit) and the servers.
    pub fn of_bench() -> Self {
        Self::start(&[std::process::id()])
    }

    /// Close the window.
    pub fn finish(&self) -> Used {
        Used { cpu: Cpu::so_far(&self.pids) - self.cpu, busy: self.machine.finish() }
    }
}

/// How busy the whole machine is over a window, from the first line of `/proc/stat`.
pub struct Busy {
    /// CPU ticks so far: (busy, busy + idle).
    at_start: (u64, u64),
}

impl Busy {
    /// Open a window.
    pub fn start() -> Self {
        Self { at_start: machine_ticks() }
    }

    /// The share of the machine's CPU time that was busy since [`Busy::start`] (0 to 1): near 1,
    /// the window was bound by CPU; well below, by waiting (round trips, one batch at a time).
    pub fn finish(&self) -> f64 {
        let (busy, total) = machine_ticks();
        (busy - self.at_start.0) as f64 / (total - self.at_start.1).max(1) as f64
    }
}

/// The whole machine's CPU ticks so far, (busy, busy + idle), from the first line of `/proc/stat`:
/// user, nice, system, idle, iowait, irq, softirq, steal. Time stolen by the hypervisor counts as
/// neither: it was never ours to use.
fn machine_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> =
        stat.lines().next().unwrap_or("").split_whitespace().skip(1).map(|v| v.parse().unwrap_or(0)).collect();
    let at = |index: usize| ticks.get(index).copied().unwrap_or(0);
    let busy = at(0) + at(1) + at(2) + at(5) + at(6);
    (busy, busy + at(3) + at(4))
}

/// What `pg_stat_database` has counted so far in some databases.
#[derive(Debug, Clone, Copy)]
pub struct DatabaseCounts {
    /// Transactions committed.
    pub commits: i64,
    /// Deadlocks detected: each broken by failing one of its transactions.
    pub deadlocks: i64,
}

/// What `pg_stat_database` has counted so far in `databases`, as of the statistics' last flush:
/// read after a phase has settled.
pub async fn database_counts(pool: &PgPool, databases: &[String]) -> DatabaseCounts {
    // Statistics reach the shared view within a second of a backend going idle.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (commits, deadlocks) = sqlx::query_as(
        "select coalesce(sum(xact_commit), 0)::int8, coalesce(sum(deadlocks), 0)::int8
           from pg_stat_database where datname = any($1)",
    )
    .bind(databases)
    .fetch_one(pool)
    .await
    .expect("pg_stat_database");
    DatabaseCounts { commits, deadlocks }
}
