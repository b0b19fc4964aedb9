//! A highly available Postgres, run as production runs one: two Postgres 15 nodes managed by
//! Patroni (its leader key in etcd), streaming replication in synchronous mode, behind HAProxy,
//! which sends every connection to the node Patroni's REST API calls the primary (`/primary`).
//! The services are given HAProxy's address and nothing else: a failover is, to them, a
//! database that goes away and comes back at the same address (`docs/guarantees.md`).
//!
//! Debian's `patroni`, `etcd-server` and `haproxy`, and the machine's Postgres 15 binaries. The
//! timings are a test's: a leader key that lives 10 s (Patroni's `ttl`), health checks every half
//! second.

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use tokio::process::{Child, Command};

use crate::{eventually, http, process::free_port};

/// Where the Postgres binaries Patroni runs are.
const POSTGRES_BIN: &str = "/usr/lib/postgresql/15/bin";

/// How long the pair may take to start, or to fail over.
const WAIT: Duration = Duration::from_secs(90);

/// One Postgres node and the Patroni that manages it.
#[derive(Debug)]
struct Node {
    name: String,
    data_dir: PathBuf,
    /// Postgres's port, and Patroni's REST API's.
    postgres: u16,
    rest: u16,
    /// Patroni, until killed.
    patroni: Option<Child>,
}

/// The pair, etcd and HAProxy; all stopped, and their files removed, when dropped.
#[derive(Debug)]
pub struct Patroni {
    dir: PathBuf,
    nodes: Vec<Node>,
    etcd: Child,
    haproxy: Child,
    /// HAProxy's port: the primary's address.
    port: u16,
}

impl Patroni {
    /// Start etcd, HAProxy and the first node; once it leads, the second, and wait until it is the
    /// synchronous standby and HAProxy routes to the leader. Panics, saying what to install, if
    /// a tool is missing: a test of a failover that cannot run must not pass.
    pub async fn start() -> Self {
        for tool in ["patroni", "etcd", "haproxy"] {
            let found = std::process::Command::new("sh").args(["-c", &format!("command -v {tool}")]).output();
            assert!(
                found.is_ok_and(|output| output.status.success()),
                "{tool} is missing: the failover test needs Debian's patroni, etcd-server and haproxy \
                 (apt-get install patroni etcd-server haproxy)"
            );
        }
        assert!(
            Path::new(POSTGRES_BIN).join("postgres").is_file(),
            "Postgres 15's binaries are missing in {POSTGRES_BIN}"
        );
        let dir = std::env::temp_dir().join(format!("patroni-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("create the pair's directory");
        as_postgres_owner(&dir);
        let (etcd_client, etcd_peer) = (free_port(), free_port());
        let etcd = spawn(
            &dir,
            "etcd",
            "etcd",
            &[
                "--name=etcd",
                &format!("--data-dir={}", dir.join("etcd").display()),
                &format!("--listen-client-urls=http://127.0.0.1:{etcd_client}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{etcd_client}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                &format!("--initial-cluster=etcd=http://127.0.0.1:{etcd_peer}"),
            ],
        );
        let nodes: Vec<Node> = (1..=2)
            .map(|n| Node {
                name: format!("node{n}"),
                data_dir: dir.join(format!("node{n}")),
                postgres: free_port(),
                rest: free_port(),
                patroni: None,
            })
            .collect();
        let port = free_port();
        std::fs::write(dir.join("haproxy.cfg"), haproxy_config(port, &nodes)).expect("write haproxy.cfg");
        let haproxy = spawn(&dir, "haproxy", "haproxy", &["-db", "-f", &dir.join("haproxy.cfg").display().to_string()]);
        let mut pair = Self { dir, nodes, etcd, haproxy, port };
        for index in 0..pair.nodes.len() {
            let config = pair.dir.join(format!("{}.yml", pair.nodes[index].name));
            std::fs::write(&config, patroni_config(&pair.nodes[index], etcd_client, &pair.dir)).expect("write config");
            as_postgres_owner(&config);
            let patroni = spawn(&pair.dir, &pair.nodes[index].name, "patroni", &[&config.display().to_string()]);
            pair.nodes[index].patroni = Some(patroni);
            if index == 0 {
                eventually("the first node to lead", WAIT, || async { (pair.leader().await == Some(0)).then_some(()) })
                    .await;
            }
        }
        eventually("the second node to be the synchronous standby", WAIT, || async {
            pair.answers(1, "/sync").await.then_some(())
        })
        .await;
        pair.wait_routed().await;
        pair
    }

    /// The primary's address, as a service's `DATABASE_URL` without a database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}", self.port)
    }

    /// The node that leads now, if one does.
    pub async fn leader(&self) -> Option<usize> {
        for index in 0..self.nodes.len() {
            if self.answers(index, "/primary").await {
                return Some(index);
            }
        }
        None
    }

    /// Kill the leader as a machine dies: Patroni and Postgres, `kill -9`, left down. Which node
    /// it was.
    pub async fn kill_leader(&mut self) -> usize {
        let leader = self.leader().await.expect("a leader to kill");
        let node = &mut self.nodes[leader];
        if let Some(mut patroni) = node.patroni.take() {
            let _ = patroni.start_kill();
            let _ = patroni.wait().await;
        }
        assert!(kill_postmaster(&node.data_dir), "node{} has no postmaster to kill", leader + 1);
        leader
    }

    /// Wait until a node other than `old` leads and HAProxy routes there; which one.
    pub async fn wait_for_new_leader(&self, old: usize) -> usize {
        let leader =
            eventually("another node to lead", WAIT, || async { self.leader().await.filter(|n| *n != old) }).await;
        self.wait_routed().await;
        leader
    }

    /// Whether Patroni's REST API on node `index` answers `path` with 200.
    async fn answers(&self, index: usize, path: &str) -> bool {
        let url = format!("http://127.0.0.1:{}{path}", self.nodes[index].rest);
        matches!(
            tokio::time::timeout(Duration::from_secs(2), http::request("GET", &url, &[], None)).await,
            Ok(Ok(response)) if response.status == 200
        )
    }

    /// Wait until HAProxy's address takes a write.
    async fn wait_routed(&self) {
        let url = format!("{}/postgres", self.url());
        eventually("HAProxy to route to the leader", WAIT, || async {
            let options: sqlx::postgres::PgConnectOptions = url.parse().ok()?;
            let mut connection = sqlx::ConnectOptions::connect(&options).await.ok()?;
            let writable: bool =
                sqlx::query_scalar("select not pg_is_in_recovery()").fetch_one(&mut connection).await.ok()?;
            writable.then_some(())
        })
        .await;
    }
}

impl Drop for Patroni {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(patroni) = node.patroni.as_mut() {
                let _ = patroni.start_kill();
            }
            kill_postmaster(&node.data_dir);
        }
        let _ = self.etcd.start_kill();
        let _ = self.haproxy.start_kill();
        if std::thread::panicking() {
            // The nodes' logs and data explain the failure: keep them.
            eprintln!("patroni: the failed test's nodes, logs and data are in {}", self.dir.display());
        } else {
            // Postgres may still be writing for a moment after its kill; what is left is temp.
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `kill -9` the postmaster of `data_dir`, if its pid file names one that is still that
/// postmaster (a pid left in the file of a node killed earlier may be another process's by now);
/// its backends exit when they see it gone. Whether it killed one.
fn kill_postmaster(data_dir: &Path) -> bool {
    let pid_file = std::fs::read_to_string(data_dir.join("postmaster.pid")).unwrap_or_default();
    let Some(pid) = pid_file.lines().next().filter(|pid| pid.parse::<u32>().is_ok()) else { return false };
    // Patroni starts it as `postgres -D <data_dir> …`: its command line names the directory.
    let command_line = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let ours = String::from_utf8_lossy(&command_line).contains(&*data_dir.to_string_lossy());
    ours && std::process::Command::new("kill")
        .args(["-9", pid])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The uid and gid of the `postgres` user when running as root (Postgres refuses to run as root),
/// else `None`: run as ourselves.
fn postgres_user() -> Option<(u32, u32)> {
    let uid = std::process::Command::new("id").arg("-u").output().ok()?;
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let line = passwd.lines().find(|line| line.starts_with("postgres:"))?;
    let fields: Vec<&str> = line.split(':').collect();
    Some((fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?))
}

/// Hand `path` to the user the pair runs as.
fn as_postgres_owner(path: &Path) {
    if let Some((uid, gid)) = postgres_user() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown to postgres");
    }
}

/// Start `program` with `args` as the pair's user, its output in `dir/<name>.log`, killed if the
/// test ends first.
fn spawn(dir: &Path, name: &str, program: &str, args: &[&str]) -> Child {
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("create a log");
    let mut command = std::process::Command::new(program);
    command
        .args(args)
        .current_dir(dir)
        .env("HOME", dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log);
    if let Some((uid, gid)) = postgres_user() {
        command.uid(uid).gid(gid);
    }
    let mut command = Command::from(command);
    command.kill_on_drop(true);
    command.spawn().unwrap_or_else(|error| panic!("start {program}: {error}"))
}

/// HAProxy in front of the pair: each node checked on Patroni's `/primary` every half second,
/// two failures mark it down and cut its sessions, so that clients reconnect to the new leader.
fn haproxy_config(port: u16, nodes: &[Node]) -> String {
    let servers: String = nodes
        .iter()
        .map(|node| format!("  server {} 127.0.0.1:{} check port {}\n", node.name, node.postgres, node.rest))
        .collect();
    format!(
        "global\n  maxconn 2000\n\
         defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 30m\n  timeout server 30m\n  timeout check 1s\n\
         listen primary\n  bind 127.0.0.1:{port}\n  option httpchk OPTIONS /primary\n  http-check expect status 200\n  \
         default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions\n{servers}"
    )
}

/// A node's Patroni: synchronous mode (a commit returns once the standby has it, and only a
/// synchronous standby is promoted), trust on loopback, a leader key of 10 s.
fn patroni_config(node: &Node, etcd: u16, dir: &Path) -> String {
    format!(
        "scope: shop\n\
         name: {name}\n\
         restapi:\n  listen: 127.0.0.1:{rest}\n  connect_address: 127.0.0.1:{rest}\n\
         etcd3:\n  hosts: 127.0.0.1:{etcd}\n\
         bootstrap:\n  dcs:\n    ttl: 10\n    loop_wait: 1\n    retry_timeout: 4\n    synchronous_mode: true\n    \
         postgresql:\n      use_pg_rewind: true\n      parameters:\n        max_connections: 400\n        \
         wal_log_hints: 'on'\n  \
         initdb:\n    - encoding: UTF8\n    - locale: C.UTF-8\n  \
         pg_hba:\n    - local all all trust\n    - host replication all 127.0.0.1/32 trust\n    \
         - host all all 127.0.0.1/32 trust\n\
         postgresql:\n  listen: 127.0.0.1:{postgres}\n  connect_address: 127.0.0.1:{postgres}\n  \
         data_dir: {data}\n  bin_dir: {POSTGRES_BIN}\n  pgpass: {dir}/{name}.pgpass\n  \
         authentication:\n    replication:\n      username: postgres\n    superuser:\n      username: postgres\n  \
         parameters:\n    unix_socket_directories: {dir}\n",
        name = node.name,
        rest = node.rest,
        postgres = node.postgres,
        data = node.data_dir.display(),
        dir = dir.display(),
    )
}
