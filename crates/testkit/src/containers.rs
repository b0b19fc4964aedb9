//! Containers for machines without local servers. One pair per machine, by name, that every test
//! binary and every run reuses (each test has its own databases and vhost, so sharing is safe):
//! a test process never removes what it started, so a pair per process would pile up. Their
//! names carry the tag, so a version change starts a new pair; `docker rm -f $(docker ps -aq
//! --filter name=reliable-orders-test-)` removes them.

use testcontainers::{ContainerRequest, Image, ReuseDirective};
use testcontainers_modules::{
    postgres::Postgres,
    rabbitmq::RabbitMq,
    testcontainers::{ContainerAsync, ImageExt, runners::AsyncRunner},
};
use tokio::sync::OnceCell;

static RUNNING: OnceCell<(ContainerAsync<Postgres>, ContainerAsync<RabbitMq>)> = OnceCell::const_new();

/// Start the container `request` makes, or reuse the running one of its name. Test processes
/// started at once (nextest runs one per test) race to create it: the losers get Docker's
/// 409 Conflict on the name while the winner's container is created but not yet running, and
/// try again until it is (measured: a single retry came too soon). A pull that breaks off is
/// tried again too, [`PULLS`] times in all: a first pull through a registry mirror that has not
/// cached the image yet once ended with `bytes remaining on stream`, and the next one worked.
async fn start_or_reuse<I: Image>(request: impl Fn() -> ContainerRequest<I>) -> Result<ContainerAsync<I>, String> {
    let deadline = tokio::time::Instant::now() + STARTUP;
    let mut pulls = 1;
    loop {
        match request().start().await {
            Ok(container) => return Ok(container),
            Err(error) if error.to_string().contains("Conflict") && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            Err(error) if error.to_string().contains("failed to pull the image") && pulls < PULLS => {
                eprintln!("testkit: {error}; pulling again");
                pulls += 1;
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
            Err(error) => return Err(error.to_string()),
        }
    }
}

/// Pulls of an image before its failure is reported.
const PULLS: u32 = 3;

pub(super) async fn start() -> Result<super::Servers, String> {
    let (postgres, rabbitmq) = RUNNING
        .get_or_try_init(|| async {
            // The versions users run (compose.yaml), not the modules' old defaults (Postgres 11
            // lacks `drop database ... with (force)`; RabbitMQ 3.8 lacks quorum-queue TTLs).
            let postgres = || {
                Postgres::default()
                    .with_password(POSTGRES_PASSWORD)
                    .with_tag(super::POSTGRES_TAG)
                    .with_container_name(postgres_name())
                    .with_reuse(ReuseDirective::Always)
            };
            let rabbitmq = || {
                RabbitMq::default()
                    .with_tag(super::RABBITMQ_TAG)
                    .with_container_name(rabbitmq_name())
                    .with_reuse(ReuseDirective::Always)
            };
            Ok::<_, String>((start_or_reuse(postgres).await?, start_or_reuse(rabbitmq).await?))
        })
        .await?;
    let pg_port = postgres.get_host_port_ipv4(5432).await.map_err(|e| e.to_string())?;
    let amqp_port = rabbitmq.get_host_port_ipv4(5672).await.map_err(|e| e.to_string())?;
    let http_port = rabbitmq.get_host_port_ipv4(15672).await.map_err(|e| e.to_string())?;
    let servers = super::Servers {
        postgres: format!("postgres://postgres:{POSTGRES_PASSWORD}@127.0.0.1:{pg_port}"),
        amqp: vec![format!("amqp://guest:guest@127.0.0.1:{amqp_port}")],
        management: format!("http://guest:guest@127.0.0.1:{http_port}"),
        rabbitmqctl: Some(format!("docker exec {} rabbitmqctl", rabbitmq_name())),
        postgres_exec: Some(format!("docker exec -i {}", postgres_name())),
    };
    // A reused container was started by another test process and may not be up yet (only a
    // fresh start waits for its log line): a vhost created before the management API answers
    // would go to the local broker's rabbitmqctl instead.
    let overview = super::http::join(&servers.management, "/api/overview");
    super::eventually("the container's RabbitMQ management API", STARTUP, || async {
        let response = super::http::request("GET", &overview, &[], None).await.ok()?;
        (response.status == 200).then_some(())
    })
    .await;
    let postgres = super::http::join(&servers.postgres, "/postgres");
    super::eventually("the container's Postgres", STARTUP, || async {
        sqlx::PgPool::connect(&postgres).await.ok().map(drop)
    })
    .await;
    Ok(servers)
}

/// The Postgres container's password: one no default or help text holds (`settings`' secret-file
/// test takes it for the secret that must never be printed; the image's default, `postgres`, is in
/// every default URL). A change needs a new container name: a reused container keeps its password.
const POSTGRES_PASSWORD: &str = "testkit-c0ntainer-pw";

/// The Postgres container's name: its tag, and the password's generation.
fn postgres_name() -> String {
    format!("reliable-orders-test-postgres-{}-pw2", super::POSTGRES_TAG)
}

/// The RabbitMQ container's name, which `docker exec` reaches it by.
fn rabbitmq_name() -> String {
    format!("reliable-orders-test-rabbitmq-{}", super::RABBITMQ_TAG)
}

/// How long a reused container may take to answer after another process started it.
const STARTUP: std::time::Duration = std::time::Duration::from_secs(120);
