//! Certificates that do not verify stop every service at start-up: exit status 2, one line that
//! names the server and rustls' reason, and nothing written (no database created, no queue
//! declared). Needs the servers of `.ci/tls-servers` (`eval "$(.ci/tls-servers env 3.10)"`), which
//! set `TEST_TLS_OTHER_CA`, `TEST_TLS_EXPIRED_POSTGRES_URL` and `TEST_TLS_EXPIRED_AMQP_URL`.
//! The README's test command has none, so the tests are ignored there, visibly; CI runs them
//! with `--ignored`, and a run that asks for them without the servers fails.

use std::time::Duration;

use testkit::{TestEnv, process, shop::Service};

/// A server URL with one change: its host, or one of its query parameters.
fn changed(url: &str, host: Option<&str>, query: Option<(&str, &str)>) -> String {
    let mut parsed = url::Url::parse(url).expect("url");
    if let Some(host) = host {
        parsed.set_host(Some(host)).expect("host");
    }
    if let Some((key, value)) = query {
        let kept: Vec<(String, String)> =
            parsed.query_pairs().filter(|(k, _)| k != key).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        parsed.query_pairs_mut().clear().extend_pairs(kept).append_pair(key, value);
    }
    parsed.to_string()
}

/// The other CA's file, and the servers with an expired certificate (Postgres, RabbitMQ).
fn tls_servers() -> (String, String, String) {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: start .ci/tls-servers and eval its env"))
    };
    (var("TEST_TLS_OTHER_CA"), var("TEST_TLS_EXPIRED_POSTGRES_URL"), var("TEST_TLS_EXPIRED_AMQP_URL"))
}

/// Run `service` with `database_url` and `amqp_url` until it exits (30 s at most): its status and
/// the last line it wrote to stderr.
async fn run(service: Service, database_url: &str, amqp_url: &str) -> (Option<i32>, String) {
    let mut command = tokio::process::Command::new(process::binary(service.binary()));
    command
        .env_clear()
        // The orders API's one required setting (the others ignore it).
        .env("AUTH_JWT_KEY", testkit::auth::KEY)
        .env("DATABASE_URL", database_url)
        .env("AMQP_URL", amqp_url)
        .env("HTTP_ADDR", format!("127.0.0.1:{}", process::free_port()))
        .env("RUST_LOG", "warn");
    let output = process::run_to_exit(command, Duration::from_secs(30)).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    (output.status.code(), stderr.lines().last().unwrap_or_default().to_owned())
}

/// Every service against `database` and `broker` (one of them bad): exit 2, the line names
/// `server` and says `reason`, and no database or queue was made.
async fn refused(env: &TestEnv, database: impl Fn(&str) -> String, broker: &str, server: &str, reason: &str) {
    for service in Service::ALL {
        let databases = match service {
            Service::Relay => ["orders", "inventory", "billing"].map(&database).join(","),
            Service::Api => database("orders"),
            Service::Inventory => database("inventory"),
            Service::Billing => database("billing"),
        };
        let (status, line) = run(service, &databases, broker).await;
        let name = service.binary();
        assert_eq!(status, Some(2), "{name}: {line}");
        assert!(line.starts_with(&format!("{name}: cannot start: the {server} at ")), "{name}: {line}");
        assert!(line.contains(reason), "{name} says why ({reason}): {line}");
        assert!(!line.contains("tls-test-password"), "{name} prints no password: {line}");
    }
    for name in ["orders", "inventory", "billing"] {
        assert!(!env.database_exists(name).await, "no {name} database was created");
    }
    assert_eq!(env.queues().await, Vec::<String>::new(), "no queue was declared");
}

#[tokio::test]
#[ignore = "needs the TLS servers (.ci/tls-servers env); CI runs it with --ignored"]
async fn a_database_certificate_that_does_not_verify_stops_every_service() {
    let (other_ca, expired, _) = tls_servers();
    let env = TestEnv::new().await;
    let amqp = env.amqp_url();
    let wrong_ca = |name: &str| changed(&env.database_url(name), None, Some(("sslrootcert", &other_ca)));
    refused(&env, wrong_ca, &amqp, "database", "UnknownIssuer").await;
    let wrong_host = |name: &str| changed(&env.database_url(name), Some("127.0.0.2"), None);
    refused(&env, wrong_host, &amqp, "database", "not valid for name").await;
    let expired_certificate = |name: &str| {
        let mut url = url::Url::parse(&expired).expect("url");
        url.set_path(name);
        url.to_string()
    };
    refused(&env, expired_certificate, &amqp, "database", "expired").await;
}

#[tokio::test]
#[ignore = "needs the TLS servers (.ci/tls-servers env); CI runs it with --ignored"]
async fn a_broker_certificate_that_does_not_verify_stops_every_service() {
    let (other_ca, _, expired) = tls_servers();
    let env = TestEnv::new().await;
    let database = |name: &str| env.database_url(name);
    let wrong_ca = changed(&env.amqp_url(), None, Some(("cacertfile", &other_ca)));
    refused(&env, database, &wrong_ca, "broker", "UnknownIssuer").await;
    let wrong_host = changed(&env.amqp_url(), Some("127.0.0.2"), None);
    refused(&env, database, &wrong_host, "broker", "not valid for name").await;
    refused(&env, database, &expired, "broker", "expired").await;
}
