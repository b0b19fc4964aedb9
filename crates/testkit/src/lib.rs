//! The test kit: real Postgres and RabbitMQ for integration tests, never mocks.
//!
//! Servers are found in this order:
//! 1. `TEST_DATABASE_URL` / `TEST_AMQP_URL`, else `DATABASE_URL` / `AMQP_URL` (CI, and machines
//!    that run the services locally); the RabbitMQ management API is at `TEST_RABBITMQ_MANAGEMENT_URL`,
//!    default `http://guest:guest@<amqp host>:15672`;
//! 2. otherwise, containers started with `testcontainers` (needs a Docker engine);
//! 3. otherwise the test fails with a message saying how to provide them.
//!
//! Each [`TestEnv`] gets its own databases (`t_<id>_<service>`) and its own vhost, so tests run in
//! parallel without seeing each other's rows or queues. Both are removed when it is dropped.
//!
//! `RABBITMQCTL` names the `rabbitmqctl` command for that broker (words split on spaces), for a
//! broker that is not the machine's own node: `.ci/rabbitmq4 4.3 env` sets it for the RabbitMQ 4.3
//! in its chroot. Default `rabbitmqctl`. With the test kit's containers it is always `docker exec`
//! of it in the RabbitMQ container (the memory and disk alarms, `max_message_size`, a restart).

pub mod auth;
pub mod cli;
pub mod cluster;
pub use messaging::runtime::http;
pub mod ledger;
pub mod patroni;
pub mod process;
pub mod proxy;
pub mod roles;
pub mod services;
pub mod shop;

use std::{future::Future, time::Duration};

use lapin::{
    Connection,
    options::{BasicGetOptions, QueueDeclareOptions},
    types::FieldTable,
};
use sqlx::{AssertSqlSafe, PgPool, postgres::PgPoolOptions};
use tokio::sync::OnceCell;
use uuid::Uuid;

/// Where the servers are. Each URL keeps its query, where TLS settings live
/// (`?sslmode=verify-full&sslrootcert=...`, `?cacertfile=...`): paths are joined before it
/// ([`http::join`]).
#[derive(Debug, Clone)]
pub struct Servers {
    /// `postgres://user@host:port[?query]` (no database).
    postgres: String,
    /// `amqp://user:pass@host:port[?query]` (no vhost) of each of the broker's nodes: one, or a
    /// cluster's, as `AMQP_URL` lists them.
    amqp: Vec<String>,
    /// `http://user:pass@host:port[?query]` of the management API.
    management: String,
    /// The broker's `rabbitmqctl` command line when it is the test kit's container (run through
    /// `docker exec`); it comes before `RABBITMQCTL`.
    rabbitmqctl: Option<String>,
    /// How to run a command beside Postgres when it is the test kit's container (`docker exec -i
    /// NAME`): `psql` then needs no client on the host, and reaches the server by its socket.
    postgres_exec: Option<String>,
}

static SERVERS: OnceCell<Servers> = OnceCell::const_new();

fn env(names: &[&str]) -> Option<String> {
    names.iter().find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
}

/// A server URL without its path or fragment: `scheme://user:password@host:port[?query]`.
fn origin(url: &str) -> String {
    let mut parsed = url::Url::parse(url).unwrap_or_else(|error| panic!("{url} is no server URL: {error}"));
    parsed.set_path("");
    parsed.set_fragment(None);
    parsed.as_str().trim_end_matches('/').to_owned()
}

async fn servers() -> &'static Servers {
    SERVERS.get_or_init(locate_servers).await
}

async fn locate_servers() -> Servers {
    let postgres = env(&["TEST_DATABASE_URL", "DATABASE_URL"]);
    let amqp = env(&["TEST_AMQP_URL", "AMQP_URL"]);
    if let (Some(postgres), Some(amqp)) = (postgres, amqp) {
        let amqp: Vec<String> = amqp.split(',').map(|node| origin(node.trim())).collect();
        // The management API on the (first) broker node's host, as the broker's own user, unless
        // named.
        let management = env(&["TEST_RABBITMQ_MANAGEMENT_URL"])
            .or_else(|| messaging::runtime::http::management_url_of(&amqp[0]))
            .expect("AMQP URL");
        return Servers { postgres: origin(&postgres), amqp, management, rabbitmqctl: None, postgres_exec: None };
    }
    containers::start().await.unwrap_or_else(|error| {
        panic!(
            "integration tests need Postgres and RabbitMQ. Either set DATABASE_URL and AMQP_URL (or \
             TEST_DATABASE_URL and TEST_AMQP_URL) to running servers, e.g.\n  \
             DATABASE_URL=postgres://postgres@127.0.0.1:5432 AMQP_URL=amqp://guest:guest@127.0.0.1:5672 cargo test\n\
             with the RabbitMQ management plugin enabled (rabbitmq-plugins enable rabbitmq_management), \
             or run a Docker engine so testcontainers can start them. Starting containers failed: {error}"
        )
    })
}

/// The Postgres image tag of the testcontainers fallback: the one `compose.yaml` pins.
pub const POSTGRES_TAG: &str = "17.12";
/// The RabbitMQ image tag of the testcontainers fallback: the one `compose.yaml` pins.
pub const RABBITMQ_TAG: &str = "4.3.6-management";

mod containers;

/// One test's private world: databases and a vhost of its own.
#[derive(Debug)]
pub struct TestEnv {
    id: String,
    servers: &'static Servers,
    vhost: String,
}

impl TestEnv {
    /// A fresh vhost (databases are created on first use).
    pub async fn new() -> Self {
        Self::on(servers().await).await
    }

    /// [`TestEnv::new`] with its databases on the Postgres at `postgres` (`postgres://user@host:port`,
    /// e.g. [`patroni::Patroni::url`]) rather than the run's.
    pub async fn with_postgres(postgres: &str) -> Self {
        let servers = Servers { postgres: origin(postgres), postgres_exec: None, ..servers().await.clone() };
        // One per test that asks, for the test's life: a few bytes.
        Self::on(Box::leak(Box::new(servers))).await
    }

    async fn on(servers: &'static Servers) -> Self {
        let id = Uuid::new_v4().simple().to_string()[..12].to_owned();
        let vhost = format!("t-{id}");
        create_vhost(servers, &vhost).await;
        Self { id, servers, vhost }
    }

    /// Run `script` (SQL) with `psql` as the server's superuser on `database`, with `variables`
    /// (`-v NAME=VALUE`), stopping at its first error; its output. The host's `psql`, or with the
    /// test kit's containers the Postgres container's own, so that the host needs no client.
    pub async fn psql(&self, database: &str, variables: &[(&str, &str)], script: &str) -> std::process::Output {
        use tokio::io::AsyncWriteExt;
        let mut command = match &self.servers.postgres_exec {
            Some(exec) => {
                let mut words = exec.split_whitespace();
                let mut command = tokio::process::Command::new(words.next().expect("a command"));
                command.args(words).args(["psql", "-U", "postgres", "-d", database]);
                command
            }
            None => {
                let mut command = tokio::process::Command::new("psql");
                command.arg(http::join(&self.servers.postgres, &format!("/{database}")));
                command
            }
        };
        command.args(["-q", "-v", "ON_ERROR_STOP=1"]);
        for (name, value) in variables {
            command.arg("-v").arg(format!("{name}={value}"));
        }
        command.args(["-f", "-"]).stdin(std::process::Stdio::piped());
        command.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let shown = format!("{:?}", command.as_std().get_program());
        let mut child = command
            .spawn()
            .unwrap_or_else(|error| panic!("run {shown} (psql: the postgresql-client package): {error}"));
        let mut stdin = child.stdin.take().expect("psql's stdin");
        // A psql that exits early (a refused connection) is reported by its status and stderr.
        let _ = stdin.write_all(script.as_bytes()).await;
        drop(stdin);
        child.wait_with_output().await.expect("psql's output")
    }

    /// Run the real `msgctl` with `args` against this test's servers: its broker (`AMQP_URL`, the
    /// management API), the orders outbox (`DATABASE_URL`), the three services' inboxes
    /// (`INBOX_DATABASE_URL`) and the three databases of the books (`BOOKS_*_URL`).
    pub async fn msgctl(&self, args: &[&str]) -> std::process::Output {
        let inboxes = ["orders", "inventory", "billing"].map(|service| self.database_url(service)).join(",");
        tokio::process::Command::new(process::binary("msgctl"))
            .env("AMQP_URL", self.amqp_url())
            .env("RABBITMQ_MANAGEMENT_URL", self.management_url())
            .env("DATABASE_URL", self.database_url("orders"))
            .env("INBOX_DATABASE_URL", inboxes)
            .env("BOOKS_ORDERS_URL", self.database_url("orders"))
            .env("BOOKS_INVENTORY_URL", self.database_url("inventory"))
            .env("BOOKS_BILLING_URL", self.database_url("billing"))
            .args(args)
            .output()
            .await
            .expect("run msgctl")
    }

    /// This test's id: its databases are `t_<id>_<service>`, its vhost `t-<id>`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The URL of this test's database for `service` (e.g. `orders`); created by whoever connects
    /// first through [`messaging::runtime::db`], or by [`TestEnv::pool`].
    pub fn database_url(&self, service: &str) -> String {
        http::join(&self.servers.postgres, &format!("/t_{}_{service}", self.id))
    }

    /// This test's broker URL (its own vhost), as a service's `AMQP_URL`: one URL for each of
    /// the broker's nodes, separated by commas.
    pub fn amqp_url(&self) -> String {
        self.amqp_nodes().join(",")
    }

    /// This test's broker URL on each of the broker's nodes (one, unless it is a cluster).
    pub fn amqp_nodes(&self) -> Vec<String> {
        self.servers.amqp.iter().map(|node| http::join(node, &format!("/{}", self.vhost))).collect()
    }

    /// This test's vhost, `t-<id>`.
    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// The broker's management API, `http://user:pass@host:port` (every vhost's).
    pub fn management_url(&self) -> &str {
        &self.servers.management
    }

    /// A pool on this test's database for `service`, created if missing (not migrated).
    pub async fn pool(&self, service: &str) -> PgPool {
        let options: sqlx::postgres::PgConnectOptions = self.database_url(service).parse().expect("database url");
        messaging::runtime::db::create_database_if_missing(&options).await.expect("create test database");
        PgPoolOptions::new().max_connections(4).connect_with(options).await.expect("connect test database")
    }

    /// A pool on this test's database for `service`, migrated as the service does it: messaging's
    /// migrations, then its own `migrator`.
    pub async fn migrated_pool(&self, service: &str, migrator: &sqlx::migrate::Migrator) -> PgPool {
        let pool = self.pool(service).await;
        messaging::schema::migrate(&pool, migrator).await.expect("migrate test database");
        pool
    }

    /// A pool on this test's database `name` with messaging's tables only (outbox, inbox, crash
    /// ledger): a service of the test's own making.
    pub async fn messaging_pool(&self, name: &str) -> PgPool {
        let pool = self.pool(name).await;
        messaging::schema::MIGRATOR.run(&pool).await.expect("migrate test database");
        pool
    }

    /// A broker connection on this test's vhost (on the first node that answers).
    pub async fn amqp(&self) -> Connection {
        let nodes = self.amqp_url().parse().expect("the test broker's nodes");
        messaging::runtime::broker::connect_any(&nodes, 0, "test").await.expect("connect to test vhost").0
    }

    /// Declare `endpoint`'s queues on this test's vhost as its consumer would (work queue, retry
    /// tiers, parking, dead-letter intake), so that what is published before the consumer starts
    /// waits for it.
    pub async fn declare_endpoint(
        &self,
        endpoint: &messaging::topology::Endpoint,
        policy: &messaging::topology::RetryPolicy,
    ) {
        let connection = self.amqp().await;
        messaging::topology::declare_endpoint(&connection, endpoint, policy).await.expect("declare");
        let _ = connection.close(200, "bye".into()).await;
    }

    /// Consumer settings for a test on this test's broker: fast reconnects (20 ms to 200 ms), a
    /// crash bound of 3, a 10 s handler timeout, a 14-day inbox retention, the default confirm
    /// timeout and channels renewed after a minute idle.
    pub fn consumer_settings(
        &self,
        endpoint: messaging::topology::Endpoint,
        policy: messaging::topology::RetryPolicy,
        prefetch: u16,
        batch: messaging::consumer::Batching,
    ) -> messaging::consumer::ConsumerSettings {
        messaging::consumer::ConsumerSettings {
            endpoint,
            policy,
            prefetch,
            batch,
            amqp_url: self.amqp_url().parse().expect("the test broker's URL"),
            reconnect: messaging::runtime::backoff::Backoff::new(Duration::from_millis(20), Duration::from_millis(200)),
            max_crashes: 3,
            handler_timeout: Duration::from_secs(10),
            inbox_retention: Duration::from_secs(14 * 86_400),
            confirm_timeout: messaging::publisher::CONFIRM_TIMEOUT,
            idle_renewal: Some(Duration::from_secs(60)),
        }
    }

    /// Publish `body` as a message of contract `C` belonging to job `job_id`, `copies` times under
    /// one message id (as a relay that crashed between a confirm and its mark would), each copy
    /// confirmed. Returns the message id.
    pub async fn publish<C: messaging::contracts::Contract>(&self, body: &C, job_id: Uuid, copies: usize) -> Uuid {
        self.publish_under(body, body.routing_key(), job_id, copies).await
    }

    /// As [`TestEnv::publish`], under `routing_key` rather than the contract's (an earlier
    /// release's key, say).
    pub async fn publish_under<C: messaging::contracts::Contract>(
        &self,
        body: &C,
        routing_key: &str,
        job_id: Uuid,
        copies: usize,
    ) -> Uuid {
        let connection = self.amqp().await;
        let publisher = messaging::publisher::Publisher::open(&connection).await.expect("publisher");
        let message_id = Uuid::now_v7();
        let properties =
            messaging::envelope::Headers::of::<C>(Some(job_id)).properties(message_id, C::TYPE, chrono::Utc::now());
        let payload = serde_json::to_vec(body).expect("json");
        for _ in 0..copies {
            publisher.publish(C::EXCHANGE, routing_key, &payload, properties.clone()).await.expect("confirmed");
        }
        let _ = connection.close(200, "bye".into()).await;
        message_id
    }

    /// The broker's version, e.g. `4.0.5`, from the management API.
    pub async fn broker_version(&self) -> String {
        let response = http::request("GET", &http::join(&self.servers.management, "/api/overview"), &[], None)
            .await
            .expect("GET /api/overview of the RabbitMQ management API");
        response.json()["rabbitmq_version"].as_str().expect("rabbitmq_version").to_owned()
    }

    /// The broker's major version.
    pub async fn broker_major(&self) -> u32 {
        self.broker_line().await.0
    }

    /// The broker's release line, `(major, minor)`: `(4, 3)` for 4.3.6. Quorum-queue semantics
    /// moved within 4.x (`tests/broker_semantics.rs`), so the major alone does not say enough.
    pub async fn broker_line(&self) -> (u32, u32) {
        let version = self.broker_version().await;
        let mut parts = version.split('.').map(|part| part.parse::<u32>());
        match (parts.next(), parts.next()) {
            (Some(Ok(major)), Some(Ok(minor))) => (major, minor),
            _ => panic!("{version} is no version such as 4.3.6"),
        }
    }

    /// The broker's own headers (`x-...`) that were published with `delivery`, read back from a
    /// quorum queue of this broker. RabbitMQ 3.x sets `x-delivery-count` on every delivery from a
    /// quorum queue itself, overwriting any published value, so there it tells nothing about what
    /// was published; 4.x passes a published one through. Pinned by `tests/broker_semantics.rs`.
    pub async fn published_broker_headers(&self, delivery: &lapin::message::Delivery) -> Vec<String> {
        let set_on_delivery = if self.broker_major().await < 4 { Some("x-delivery-count") } else { None };
        let Some(headers) = delivery.properties.headers() else { return Vec::new() };
        headers
            .inner()
            .keys()
            .map(|key| key.as_str().to_owned())
            .filter(|key| key.starts_with("x-") && Some(key.as_str()) != set_on_delivery)
            .collect()
    }

    /// The names of the queues in this test's vhost, from the management API.
    pub async fn queues(&self) -> Vec<String> {
        let url = http::join(&self.servers.management, &format!("/api/queues/{}?columns=name", self.vhost));
        let response = http::request("GET", &url, &[], None).await.expect("GET /api/queues of the management API");
        assert_eq!(response.status, 200, "{}", String::from_utf8_lossy(&response.body));
        let names = response.json();
        names.as_array().expect("a list").iter().filter_map(|queue| queue["name"].as_str().map(str::to_owned)).collect()
    }

    /// This test's database for `service` refuses writes from now on (`on`: its sessions ended, as
    /// a failover ends them, so that whoever uses it reconnects into read-only sessions), or takes
    /// them again (the sessions opened meanwhile stay read-only, as after a failover back).
    pub async fn read_only(&self, service: &str, on: bool) {
        let server = http::join(&self.servers.postgres, "/postgres");
        let mut admin =
            <sqlx::PgConnection as sqlx::Connection>::connect(&server).await.expect("connect to the server");
        let name = format!("t_{}_{service}", self.id);
        let setting = if on { "set default_transaction_read_only = on" } else { "reset default_transaction_read_only" };
        // An identifier made by the test kit, never input.
        let alter = format!("alter database \"{name}\" {setting}");
        sqlx::query(AssertSqlSafe(alter)).execute(&mut admin).await.expect("alter database");
        if on {
            sqlx::query("select pg_terminate_backend(pid) from pg_stat_activity where datname = $1")
                .bind(&name)
                .execute(&mut admin)
                .await
                .expect("end the database's sessions");
        }
        let _ = sqlx::Connection::close(admin).await;
    }

    /// Whether this test's database for `service` exists (without creating it).
    pub async fn database_exists(&self, service: &str) -> bool {
        let server = http::join(&self.servers.postgres, "/postgres");
        let pool = PgPoolOptions::new().max_connections(1).connect(&server).await.expect("connect to the server");
        let name = format!("t_{}_{service}", self.id);
        let exists = sqlx::query_scalar("select exists (select 1 from pg_database where datname = $1)")
            .bind(&name)
            .fetch_one(&pool)
            .await
            .expect("look the database up");
        pool.close().await;
        exists
    }

    /// Messages ready in `queue` (`None` if it does not exist).
    pub async fn queue_depth(&self, queue: &str) -> Option<u32> {
        let connection = self.amqp().await;
        let channel = connection.create_channel().await.expect("channel");
        let declared = channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions { passive: true, ..Default::default() },
                FieldTable::default(),
            )
            .await;
        let _ = connection.close(200, "bye".into()).await;
        declared.ok().map(|queue| queue.message_count())
    }

    /// Take (and ack) every message in `queue`.
    pub async fn drain(&self, queue: &str) -> Vec<lapin::message::Delivery> {
        let connection = self.amqp().await;
        let channel = connection.create_channel().await.expect("channel");
        let mut taken = Vec::new();
        while let Some(message) =
            channel.basic_get(queue.into(), BasicGetOptions { no_ack: true }).await.expect("basic.get")
        {
            taken.push(message.delivery);
        }
        let _ = connection.close(200, "bye".into()).await;
        taken
    }
}

impl Drop for TestEnv {
    /// Remove the databases, then the tablespaces and roles named after the test, and the vhost.
    /// Runs on its own thread and runtime, since `drop` cannot await; `WITH (FORCE)` disconnects
    /// services still winding down.
    fn drop(&mut self) {
        let servers = self.servers;
        let prefix = format!("t_{}_", self.id);
        let vhost = self.vhost.clone();
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            runtime.block_on(async move {
                delete_vhost(servers, &vhost).await;
                let url = http::join(&servers.postgres, "/postgres");
                let Ok(pool) = PgPoolOptions::new().max_connections(1).connect(&url).await else {
                    return;
                };
                let drop_each = |list: &'static str, drop: fn(&str) -> String| {
                    let (pool, prefix) = (&pool, &prefix);
                    async move {
                        let names: Vec<String> =
                            sqlx::query_scalar(list).bind(prefix).fetch_all(pool).await.unwrap_or_default();
                        for name in names {
                            // The name is quoted as an identifier by `drop`.
                            let _ = sqlx::query(AssertSqlSafe(drop(&name))).execute(pool).await;
                        }
                    }
                };
                drop_each("select datname::text from pg_database where starts_with(datname, $1)", |name| {
                    format!("drop database if exists \"{name}\" with (force)")
                })
                .await;
                // Tablespaces a test made (`t_<id>_...`: a disk that fills), once empty.
                drop_each("select spcname::text from pg_tablespace where starts_with(spcname, $1)", |name| {
                    format!("drop tablespace if exists \"{name}\"")
                })
                .await;
                // The roles of a least-privilege shop (`roles::provision`), once their databases are gone.
                drop_each("select rolname::text from pg_roles where starts_with(rolname, $1)", |name| {
                    format!("drop role if exists \"{name}\"")
                })
                .await;
                pool.close().await;
            });
        });
        let _ = cleanup.join();
    }
}

async fn create_vhost(servers: &Servers, vhost: &str) {
    let api = &servers.management;
    let created = http::request("PUT", &http::join(api, &format!("/api/vhosts/{vhost}")), &[], Some("{}")).await;
    match created {
        Ok(response) if response.status < 300 => {
            let parsed = url::Url::parse(api).expect("management URL");
            let user = Some(parsed.username()).filter(|user| !user.is_empty()).unwrap_or("guest");
            let body = r#"{"configure":".*","write":".*","read":".*"}"#;
            let granted =
                http::request("PUT", &http::join(api, &format!("/api/permissions/{vhost}/{user}")), &[], Some(body))
                    .await;
            assert!(
                matches!(granted, Ok(ref r) if r.status < 300),
                "cannot grant permissions on vhost {vhost}: {granted:?}"
            );
        }
        // No management API: the local broker's own CLI can do it (slower, but CI has it).
        _ => {
            rabbitmqctl(&["add_vhost", vhost]).await;
            rabbitmqctl(&["set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"]).await;
        }
    }
}

async fn delete_vhost(servers: &Servers, vhost: &str) {
    // The broker users of a least-privilege shop (`roles::provision`) are named after the vhost.
    let users = http::request("GET", &http::join(&servers.management, "/api/users"), &[], None).await;
    if let Some(users) = users.ok().filter(|users| users.status == 200) {
        let prefix = format!("{vhost}-");
        let listed = users.json();
        let names = listed.as_array().into_iter().flatten().filter_map(|user| user["name"].as_str());
        for name in names.filter(|name| name.starts_with(&prefix)) {
            let user = http::join(&servers.management, &format!("/api/users/{name}"));
            let _ = http::request("DELETE", &user, &[], None).await;
        }
    }
    let deleted =
        http::request("DELETE", &http::join(&servers.management, &format!("/api/vhosts/{vhost}")), &[], None).await;
    if !matches!(deleted, Ok(ref r) if r.status < 300) {
        let _ = rabbitmqctl_command(&["delete_vhost", vhost]).output().await;
    }
}

/// `rabbitmqctl ARGS` for the broker under test: the test kit's container's, through `docker exec`
/// (once its servers are located); else `RABBITMQCTL`; default `rabbitmqctl`.
pub fn rabbitmqctl_command(args: &[&str]) -> tokio::process::Command {
    tokio::process::Command::from(rabbitmqctl_blocking(args))
}

/// [`rabbitmqctl_command`], to be run without a runtime (from a `Drop`, say).
pub fn rabbitmqctl_blocking(args: &[&str]) -> std::process::Command {
    // The container's first: with no URLs, a `RABBITMQCTL` left in the environment names another broker.
    let configured = SERVERS
        .get()
        .and_then(|servers| servers.rabbitmqctl.clone())
        .or_else(|| env(&["RABBITMQCTL"]))
        .unwrap_or_else(|| "rabbitmqctl".to_owned());
    let mut words = configured.split_whitespace();
    let mut command = std::process::Command::new(words.next().unwrap_or("rabbitmqctl"));
    command.args(words).args(args);
    command
}

async fn rabbitmqctl(args: &[&str]) {
    let output = rabbitmqctl_command(args).output().await;
    assert!(
        matches!(output, Ok(ref o) if o.status.success()),
        "creating a test vhost needs the RabbitMQ management API (rabbitmq-plugins enable rabbitmq_management) \
         or rabbitmqctl on PATH; `rabbitmqctl {}` failed: {output:?}",
        args.join(" ")
    );
}

/// Wait until `base` (`http://host:port`) answers `GET /readyz` with 200 and reports no broker
/// session failing beside it (the API is ready without its broker sessions, and a test wants
/// them up too), or panic after `timeout`; `note` (say, where the logs are) is added to the
/// panic message.
pub async fn wait_ready(base: &str, timeout: Duration, note: &str) {
    let url = format!("{base}/readyz");
    eventually(&format!("{url} {note}"), timeout, || async {
        let response = http::request("GET", &url, &[], None).await.ok()?;
        let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap_or_default();
        (response.status == 200 && !reports_broker_failing(&body)).then_some(())
    })
    .await;
}

/// Whether a `/readyz` body lists broker sessions failing beside the service's readiness
/// (`brokerFailing`: the API's, which stays ready without them).
pub fn reports_broker_failing(readyz: &serde_json::Value) -> bool {
    readyz["brokerFailing"].as_array().is_some_and(|failing| !failing.is_empty())
}

/// Wait until the consumer writing to `pool` has processed `message_id` (its inbox row exists), or
/// panic after `timeout`.
pub async fn wait_processed(pool: &PgPool, message_id: Uuid, timeout: Duration) {
    eventually(&format!("message {message_id} to be processed"), timeout, || async {
        let seen: i64 = sqlx::query_scalar("select count(*) from inbox where message_id = $1")
            .bind(message_id)
            .fetch_one(pool)
            .await
            .expect("inbox");
        (seen == 1).then_some(())
    })
    .await;
}

/// Poll `probe` every 20 ms until it returns `Some`, or panic after `timeout` naming `what`.
/// Tests wait for observable states this way, never for a fixed time.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    /// The files that pin the server images the suite and the demo run on (the workflow runs the
    /// test command bare, on the test kit's containers: it pins none of its own).
    const PINNING: [(&str, &str); 1] = [("compose.yaml", include_str!("../../../compose.yaml"))];

    /// Every `image: NAME:TAG` of `file` for image `name`, as `TAG`s.
    fn tags_of(file: &str, name: &str) -> Vec<String> {
        let prefix = format!("image: {name}:");
        file.lines().filter_map(|line| line.trim().strip_prefix(&prefix)).map(|tag| tag.trim().to_owned()).collect()
    }

    #[test]
    fn the_pinned_versions_agree_between_compose_and_the_container_fallback() {
        for (path, file) in PINNING {
            for (name, tag) in [("postgres", super::POSTGRES_TAG), ("rabbitmq", super::RABBITMQ_TAG)] {
                assert_eq!(tags_of(file, name), [tag], "{path} pins {name} other than testkit's {name}:{tag}");
            }
        }
        // The stand-ins CI's registry mirror serves are built and pushed under the same tags, and
        // so is every other upstream image compose names (Grafana's aside: it has no stand-in,
        // docs/ci.md): a tag changed in one place only fails here, not in the demo.
        let compose = PINNING[0].1;
        let upstream: Vec<&str> = compose
            .lines()
            .filter_map(|line| line.trim().strip_prefix("image: "))
            .map(str::trim)
            .filter(|image| !image.starts_with("reliable-orders:") && !image.starts_with("grafana/"))
            .collect();
        assert!(upstream.iter().any(|image| image.starts_with("jaegertracing/")), "{upstream:?}");
        for (path, script) in [
            ("scripts/standin-images", include_str!("../../../scripts/standin-images")),
            ("scripts/registry-mirror", include_str!("../../../scripts/registry-mirror")),
        ] {
            for image in [format!("postgres:{}", super::POSTGRES_TAG), format!("rabbitmq:{}", super::RABBITMQ_TAG)] {
                assert!(script.contains(&image), "{path} does not provide {image}");
            }
            for image in &upstream {
                assert!(script.contains(image), "{path} does not provide compose's {image}");
            }
        }
    }
}
