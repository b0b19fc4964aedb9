//! Settings a deployment relies on: secrets given as files never show (not in `--help`, the logs,
//! `/metrics` or a start-up error), and the database timeouts reach the server.

use std::time::Duration;

use messaging::runtime::db::{self, DbTimeouts};
use sqlx::{ConnectOptions, postgres::PgConnectOptions};
use testkit::{TestEnv, http, process, shop::Service};

/// The inventory database's URL with a password no server needs (the test servers trust local
/// connections) that must never be printed, and that password.
fn with_secret(env: &TestEnv) -> (String, String) {
    let secret = format!("s3cret-{}", uuid::Uuid::new_v4().simple());
    let mut url = url::Url::parse(&env.database_url("inventory")).expect("url");
    if let Some(password) = url.password().filter(|password| !password.is_empty()) {
        // A server that checks passwords: its own is the secret.
        return (url.to_string(), password.to_owned());
    }
    url.set_password(Some(&secret)).expect("password");
    (url.to_string(), secret)
}

#[tokio::test]
async fn a_secret_given_as_a_file_is_never_printed() {
    let env = TestEnv::new().await;
    let (url, secret) = with_secret(&env);
    let dir = std::env::temp_dir().join(format!("secrets-{}", env.id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("database-url");
    std::fs::write(&file, format!("{url}\n")).expect("write the secret");
    let binary = process::binary(Service::Inventory.binary());
    let base = || {
        let mut command = tokio::process::Command::new(&binary);
        command.env_clear().env("DATABASE_URL_FILE", &file).env("AMQP_URL", env.amqp_url());
        command
    };
    let run = |command| process::run_to_exit(command, Duration::from_secs(30));

    let mut help = base();
    help.arg("--help");
    let help = run(help).await;
    assert!(help.status.success());
    assert!(!String::from_utf8_lossy(&help.stdout).contains(&secret), "--help");

    // Both the variable and its file: refused, naming neither value.
    let mut both = base();
    both.env("DATABASE_URL", &url);
    let both = run(both).await;
    assert_eq!(both.status.code(), Some(2));
    let said = String::from_utf8_lossy(&both.stderr);
    assert!(said.contains("DATABASE_URL and DATABASE_URL_FILE are both set"), "{said}");
    assert!(!said.contains(&secret), "{said}");

    // The file and the flag: refused too (the relay's list would otherwise take both).
    let relay = process::binary(Service::Relay.binary());
    let mut both = tokio::process::Command::new(&relay);
    both.env_clear()
        .env("DATABASE_URL_FILE", &file)
        .env("HTTP_ADDR", format!("127.0.0.1:{}", process::free_port()))
        .args(["--database-url", &url]);
    let both = run(both).await;
    assert_eq!(both.status.code(), Some(2));
    let said = String::from_utf8_lossy(&both.stderr);
    assert!(said.contains("--database-url and DATABASE_URL_FILE are both given"), "{said}");
    assert!(!said.contains(&secret), "{said}");

    // Running: the logs and /metrics.
    let port = process::free_port();
    let log = dir.join("inventory.log");
    let mut running = tokio::process::Command::new(&binary)
        .env_clear()
        .env("DATABASE_URL_FILE", &file)
        .env("AMQP_URL", env.amqp_url())
        .env("HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "debug")
        .stdout(std::fs::File::create(&log).expect("log"))
        .stderr(std::fs::File::options().append(true).open(&log).expect("log"))
        .kill_on_drop(true)
        .spawn()
        .expect("start inventory-worker");
    let base_url = format!("http://127.0.0.1:{port}");
    testkit::wait_ready(&base_url, Duration::from_secs(60), "").await;
    let metrics = http::request("GET", &format!("{base_url}/metrics"), &[], None).await.expect("GET /metrics");
    assert!(!String::from_utf8_lossy(&metrics.body).contains(&secret), "/metrics");
    running.kill().await.expect("kill");
    let logged = std::fs::read_to_string(&log).expect("log");
    // It logged (at debug, from start-up to serving), so the check below is not vacuous.
    assert!(logged.lines().count() > 1, "the service logged: {logged}");
    assert!(!logged.contains(&secret), "the log");

    // A start-up error names the server with the password masked.
    let mut unknown_role = url::Url::parse(&url).expect("url");
    unknown_role.set_username("no_such_role").expect("user");
    std::fs::write(&file, unknown_role.as_str()).expect("write");
    let mut refused = base();
    refused.env("HTTP_ADDR", format!("127.0.0.1:{}", process::free_port()));
    let refused = run(refused).await;
    let said = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{said}");
    let line = said.lines().last().unwrap_or_default();
    assert!(line.starts_with("inventory-worker: cannot start: the database at postgres://no_such_role:***@"), "{line}");
    assert!(!said.contains(&secret), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn every_pooled_connection_carries_the_database_timeouts() {
    let env = TestEnv::new().await;
    let _pool = env.pool("orders").await;
    let options: PgConnectOptions = env.database_url("orders").parse().expect("url");
    let timeouts = DbTimeouts {
        statement: Duration::from_millis(4500),
        lock: Duration::from_millis(1500),
        idle_in_transaction: Duration::from_secs(20),
    };
    let mut connection = db::bounded(options, &timeouts).connect().await.expect("connect");
    let mut shown = Vec::new();
    for setting in ["statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"] {
        let value: String = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("show {setting}")))
            .fetch_one(&mut connection)
            .await
            .expect("show");
        shown.push(value);
    }
    assert_eq!(shown, ["4500ms", "1500ms", "20s"]);
}

/// Every service binary refuses a broker node list that is not one broker, before it connects to
/// anything: exit 2 and one line naming the entry, its password masked.
#[tokio::test]
async fn a_broker_node_list_that_is_not_one_broker_stops_every_service() {
    let nodes = "amqp://shop:s3cret@127.0.0.1:1/shop,amqp://shop:s3cret@127.0.0.1:2/billing";
    for service in Service::ALL {
        let mut command = tokio::process::Command::new(process::binary(service.binary()));
        command
            .env_clear()
            // The orders API's one required setting (the others ignore it).
            .env("AUTH_JWT_KEY", testkit::auth::KEY)
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
            .env("AMQP_URL", nodes)
            .env("HTTP_ADDR", format!("127.0.0.1:{}", process::free_port()));
        let refused = process::run_to_exit(command, Duration::from_secs(30)).await;
        let said = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{service:?}: {said}");
        assert_eq!(said.trim_end().lines().count(), 1, "{service:?}: one line: {said}");
        let named = "AMQP_URL entry 2 (amqp://shop:***@127.0.0.1:2/billing): vhost \"billing\", but entry 1 names vhost \"shop\"";
        assert!(said.contains(named), "{service:?}: {said}");
        assert!(!said.contains("s3cret"), "{service:?}: {said}");
    }
}

/// Every consuming service refuses retry tiers under which a message waiting for an earlier one
/// of its key is parked before that one has used up its retries (issue 56, row 7: an
/// `order.ended` parked while its `order.placed` still retries leaves the order `compensating`):
/// exit 2 before it connects to anything, naming the setting, nothing written.
#[tokio::test]
async fn retry_tiers_that_would_park_a_waiting_message_first_stop_every_consumer() {
    for service in [Service::Api, Service::Inventory, Service::Billing] {
        let mut command = tokio::process::Command::new(process::binary(service.binary()));
        command
            .env_clear()
            // The orders API's one required setting (the others ignore it).
            .env("AUTH_JWT_KEY", testkit::auth::KEY)
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
            .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
            .env("RETRY_DELAYS", "10ms,30m")
            .env("INBOX_RETENTION", "30d")
            .env("HTTP_ADDR", format!("127.0.0.1:{}", process::free_port()));
        let refused = process::run_to_exit(command, Duration::from_secs(30)).await;
        let said = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{service:?}: {said}");
        assert!(said.contains("RETRY_DELAYS=10ms,30m with MAX_ATTEMPTS=5"), "{service:?}: {said}");
    }
}

/// The orders API refuses, before it connects to anything, what it could not honour: a console on
/// another vhost than its own (it would act on queues the API does not serve), a console without
/// the live page it lives on, and a trace link with no place for the trace's id. Exit 2, naming
/// the setting; the console's password never shows.
#[tokio::test]
async fn the_api_refuses_a_console_or_a_trace_link_it_could_not_honour() {
    let console = |vhost: &str| format!("amqp://msgctl:s3cret@127.0.0.1:1/{vhost}");
    let cases = [
        (vec![("CONSOLE_AMQP_URL", console("other"))], "CONSOLE_AMQP_URL names vhost `other`, but AMQP_URL vhost `/`"),
        (
            vec![("CONSOLE_AMQP_URL", console("%2f")), ("LIVE_PAGE", "off".to_owned())],
            "CONSOLE_AMQP_URL is set, but LIVE_PAGE=off",
        ),
        (vec![("TRACE_VIEW_URL", "http://127.0.0.1:16686/trace/".to_owned())], "has no {traceId}"),
        (vec![("TRACE_VIEW_URL", "127.0.0.1:16686/trace/{traceId}".to_owned())], "not an http:// or https:// URL"),
    ];
    for (variables, named) in cases {
        let mut command = tokio::process::Command::new(process::binary(Service::Api.binary()));
        command
            .env_clear()
            .env("AUTH_JWT_KEY", testkit::auth::KEY)
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
            .env("AMQP_URL", "amqp://guest:guest@127.0.0.1:1/%2f")
            .env("HTTP_ADDR", format!("127.0.0.1:{}", process::free_port()))
            .envs(variables.iter().map(|(name, value)| (name, value)));
        let refused = process::run_to_exit(command, Duration::from_secs(30)).await;
        let said = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(2), "{variables:?}: {said}");
        assert!(said.contains(named), "{variables:?}: {said}");
        assert!(!said.contains("s3cret"), "{variables:?}: {said}");
    }
}
