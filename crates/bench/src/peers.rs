//! The peers: published outbox relays a team might install instead of ours, each driven by a
//! small harness (`crates/bench/peers`, versions pinned there) on a table of its own filled from
//! the same N rows our relay drains, publishing to a quorum queue with confirms, once at its
//! defaults and once tuned as its settings allow.
//!
//! A peer's drain is timed by its queue's depth, polled every 10 ms, from the first message in the
//! queue to the N-th: its process's start-up and its table's fill do not count, as our relay's
//! start-up does not. Its CPU is measured over the same window: its process, Postgres and
//! RabbitMQ.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use lapin::{Channel, options::QueueDeclareOptions, types::FieldTable};
use messaging::outbox_relay::OutboxRow;
use testkit::process;

use crate::stages::{Usage, Used};

/// The settings each peer runs with: none of its tuning parameters given, and tuned.
pub const SETTINGS: [&str; 2] = ["defaults", "tuned"];

/// One peer's harness, as `crates/bench/peers/install` names it.
pub struct Peer {
    /// e.g. `faststream-outbox`.
    pub name: String,
    /// Its pinned version.
    pub version: String,
    /// The harness: a program and its first arguments.
    command: Vec<String>,
}

/// One drain: into `queue` (declared here, a quorum queue) with `setting`, until `rows`
/// messages are in it or `limit` has passed since the first; the peer's output goes to `log`.
pub struct Run<'a> {
    /// The peer's database, filled by [`Peer::fill`].
    pub database_url: &'a str,
    /// The broker, with the vhost.
    pub amqp_url: &'a str,
    /// The queue it publishes to.
    pub queue: &'a str,
    /// One of [`SETTINGS`].
    pub setting: &'a str,
    /// The rows in its table.
    pub rows: usize,
    /// The longest it is timed.
    pub limit: Duration,
    /// Its output.
    pub log: PathBuf,
}

/// What a peer's drain came to.
pub struct Drain {
    /// Messages per second between the first and the last one timed.
    pub rate: f64,
    /// Messages that reached the queue while it was timed.
    pub published: u64,
    /// Seconds timed.
    pub seconds: f64,
    /// Whether it reached every row before the limit.
    pub complete: bool,
    /// The peer's process, Postgres and RabbitMQ over the window.
    pub used: Used,
}

/// Install (or find installed) every peer; the error says which step failed.
pub fn install() -> Result<Vec<Peer>, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/install");
    let output = std::process::Command::new("bash")
        .arg(script)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|error| format!("{script}: {error}"))?;
    if !output.status.success() {
        return Err(format!("{script} failed ({})", output.status));
    }
    let peers = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace().map(str::to_owned);
            let (name, version) = (words.next()?, words.next()?);
            Some(Peer { name, version, command: words.collect() })
        })
        .collect::<Vec<_>>();
    if peers.is_empty() {
        return Err(format!("{script} named no peer"));
    }
    Ok(peers)
}

/// The file the harnesses fill their tables from: one JSON line per row, its payload as stored
/// and the headers our relay publishes it with (the message id and type among them).
pub fn write_rows(rows: &[OutboxRow], path: &Path) {
    let lines: Vec<String> = rows
        .iter()
        .map(|row| {
            let mut headers = match serde_json::to_value(&row.headers.0).expect("headers as JSON") {
                serde_json::Value::Object(fields) => fields,
                _ => serde_json::Map::new(),
            };
            headers.retain(|_, value| !value.is_null());
            headers.insert("message-id".into(), row.message_id.to_string().into());
            headers.insert("message-type".into(), row.message_type.clone().into());
            serde_json::json!({ "payload": row.payload, "headers": headers }).to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").expect("write the peers' rows");
}

impl Peer {
    /// e.g. `faststream-outbox 0.19.0`.
    pub fn label(&self) -> String {
        format!("{} {}", self.name, self.version)
    }

    fn command(&self, arguments: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.command[0]);
        command.args(&self.command[1..]).args(arguments).kill_on_drop(true);
        command
    }

    /// Create the peer's table in `database_url` and fill it from `rows_file`.
    pub async fn fill(&self, database_url: &str, rows_file: &Path) {
        let rows_file = rows_file.to_str().expect("a UTF-8 path");
        let fill = self.command(&["fill", database_url, rows_file]);
        let output = process::run_to_exit(fill, Duration::from_secs(600)).await;
        assert!(output.status.success(), "{} fill: {}", self.name, String::from_utf8_lossy(&output.stderr));
    }

    /// Relay the filled table as `run` says, timed by its queue's depth.
    pub async fn drain(&self, channel: &Channel, run: Run<'_>) -> Drain {
        let Run { database_url, amqp_url, queue, setting, rows, limit, log } = run;
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), lapin::types::AMQPValue::LongString("quorum".into()));
        channel
            .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
            .await
            .expect("declare the peer's queue");
        let output = std::fs::File::create(&log).expect("peer log");
        let mut relay = self
            .command(&["relay", database_url, amqp_url, queue, setting])
            .stdout(output.try_clone().expect("log"))
            .stderr(output)
            .spawn()
            .expect("start the peer's relay");
        let pid = relay.id().expect("the relay's pid");
        let depth = async || {
            let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
            let declared = channel.queue_declare(queue.into(), passive, FieldTable::default()).await;
            u64::from(declared.expect("the peer's queue").message_count())
        };
        // Up to a minute for the first message: start-up, connections, the first claim.
        let started = Instant::now();
        let mut first = depth().await;
        while first == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{}: nothing published in 60 s; see {}",
                self.name,
                log.display()
            );
            if let Ok(Some(status)) = relay.try_wait() {
                panic!("{} relay exited ({status}); see {}", self.name, log.display());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            first = depth().await;
        }
        let (window, timed_from) = (Usage::start(&[pid]), Instant::now());
        let mut last = first;
        while last < rows as u64 && timed_from.elapsed() < limit {
            tokio::time::sleep(Duration::from_millis(10)).await;
            last = depth().await;
        }
        let (used, seconds) = (window.finish(), timed_from.elapsed().as_secs_f64());
        process::terminate(&mut relay, Duration::from_secs(10)).await;
        let published = last - first;
        Drain { rate: published as f64 / seconds, published, seconds, complete: last >= rows as u64, used }
    }
}
