//! Every service under its own least-privilege database roles and broker user, made by the DBA's
//! scripts (`ops/postgres/roles.sql`, `ops/rabbitmq/users.sh`), with its URLs given as files: the
//! order flow works, and each account can do only what its service needs.

use lapin::{
    BasicProperties,
    options::{BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions},
    types::FieldTable,
};
use messaging::{
    contracts::{Contract, JobAbandoned},
    publisher::Publisher,
    runtime::config::SecretUrl,
};
use sqlx::Connection;
use testkit::{
    process,
    roles::{Accounts, as_user},
    shop::{Options, Service, Shop},
};

async fn least_privilege_shop() -> Shop {
    Shop::start(Options { least_privilege: true, ..Options::default() }).await
}

/// The role names of the shop, from its databases' names (`t_<id>_orders`).
fn role(shop: &Shop, name: &str) -> String {
    format!("t_{}_{name}", shop.env.id())
}

#[tokio::test]
async fn the_order_flow_runs_with_a_role_and_a_user_per_service() {
    let mut shop = least_privilege_shop().await;
    shop.place_burst(20).await;
    let ledger = shop.assert_books_balance().await;
    assert!(ledger.succeeded > 0, "{ledger}");
    // Nobody but the owner made the tables: the runtime roles own nothing.
    let owners: Vec<String> =
        sqlx::query_scalar("select distinct tableowner::text from pg_tables where schemaname = 'public'")
            .fetch_all(&shop.inventory)
            .await
            .expect("table owners");
    assert_eq!(owners, [role(&shop, "inventory_owner")]);
    // The API checks the books through the read-only role, and they agree.
    testkit::eventually("the books checked", testkit::shop::WAIT, || async {
        (shop.metric(Service::Api, "books_check_up").await == 1).then_some(())
    })
    .await;
    assert_eq!(shop.metric(Service::Api, "books_disagreements").await, 0);
    shop.stop().await;
}

#[tokio::test]
async fn the_inventory_role_cannot_reach_the_orders_database_nor_change_its_own_schema() {
    let shop = least_privilege_shop().await;
    let inventory = role(&shop, "inventory");
    let orders_db = format!("/{}", role(&shop, "orders"));
    let refused = sqlx::PgConnection::connect(&as_user(&shop.env.database_url("orders"), &inventory, Some(&orders_db)))
        .await
        .expect_err("the inventory role may not connect to the orders database");
    let code = refused.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned());
    assert_eq!(code.as_deref(), Some("42501"), "insufficient_privilege: {refused}");

    let mut own = sqlx::PgConnection::connect(&as_user(&shop.env.database_url("inventory"), &inventory, None))
        .await
        .expect("the inventory role connects to its database");
    for statement in
        ["create table extra (id int)", "drop table stock", "truncate stock", "alter table stock add x int"]
    {
        let error = sqlx::query(statement).execute(&mut own).await.expect_err(statement);
        let code = error.as_database_error().and_then(|e| e.code()).map(|code| code.into_owned());
        assert_eq!(code.as_deref(), Some("42501"), "{statement}: {error}");
    }
    shop.stop().await;
}

#[tokio::test]
async fn the_inventory_user_cannot_consume_declare_purge_delete_or_write_into_billing_queues() {
    let shop = least_privilege_shop().await;
    let user = format!("t-{}-inventory-worker", shop.env.id());
    let url = SecretUrl::new(as_user(&shop.env.amqp_url(), &user, None));
    let connection =
        messaging::runtime::broker::connect(&url, "least-privilege test").await.expect("connect as inventory");
    let billing = "billing.inventory-reserved";
    // Each refusal closes its channel (403 ACCESS_REFUSED); a fresh channel for each.
    let channel = connection.create_channel().await.expect("channel");
    let consumed = channel
        .basic_consume(billing.into(), "spy".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await;
    assert!(consumed.is_err(), "consuming the billing queue is refused");
    let channel = connection.create_channel().await.expect("channel");
    let declared = channel
        .queue_declare(
            format!("{billing}.extra").as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await;
    assert!(declared.is_err(), "declaring a queue of billing's is refused");
    let channel = connection.create_channel().await.expect("channel");
    assert!(channel.queue_purge(billing.into(), QueuePurgeOptions::default()).await.is_err(), "purge is refused");
    let channel = connection.create_channel().await.expect("channel");
    assert!(channel.queue_delete(billing.into(), QueueDeleteOptions::default()).await.is_err(), "delete is refused");
    // Nor put a message into billing's queues: not by name through the default exchange, not
    // through billing's own exchange. Its own exchange takes a copy for its own parking queue.
    let copy = || BasicProperties::default().with_message_id(uuid::Uuid::new_v4().to_string().into());
    for (exchange, queue) in
        [("", billing.to_owned()), ("billing.inventory-reserved.direct", format!("{billing}.parking"))]
    {
        let publisher = Publisher::open(&connection).await.expect("publisher");
        let sent = publisher.publish(exchange, &queue, b"{}", copy()).await;
        assert!(sent.is_err(), "a publish into {queue} through {exchange:?} is refused");
    }
    let publisher = Publisher::open(&connection).await.expect("publisher");
    let own = "inventory.order-placed.parking";
    publisher.publish("inventory.order-placed.direct", own, b"{}", copy()).await.expect("its own parking");
    let _ = connection.close(200, "bye".into()).await;
    assert_eq!(shop.env.queue_depth(own).await, Some(1), "its own copy arrived");
    for queue in [billing.to_owned(), format!("{billing}.parking")] {
        assert_eq!(shop.env.queue_depth(&queue).await, Some(0), "nothing reached {queue}");
    }
    // Its own queue it may consume, and billing's is still there.
    assert!(shop.env.queues().await.iter().all(|queue| !queue.ends_with(".extra")), "nothing was declared");
    shop.stop().await;
}

/// Publish a `job.abandoned` for `job_id` as broker user `user` of `shop`: whether the broker
/// confirmed it.
async fn abandon_as(shop: &Shop, user: &str, job_id: uuid::Uuid) -> Result<(), messaging::publisher::PublishError> {
    let url = SecretUrl::new(as_user(&shop.env.amqp_url(), user, None));
    let connection = messaging::runtime::broker::connect(&url, "least-privilege test").await.expect("connect");
    let event = JobAbandoned {
        job_id,
        endpoint: "billing.inventory-reserved".into(),
        message_id: uuid::Uuid::new_v4(),
        reason: format!("abandoned by {user}"),
    };
    let (body, properties) = messaging::envelope::job_event(&event).expect("the event");
    let publisher = Publisher::open(&connection).await.expect("publisher");
    let sent = publisher.publish(JobAbandoned::EXCHANGE, JobAbandoned::TYPE, &body, properties).await.map(|_| ());
    let _ = connection.close(200, "bye".into()).await;
    sent
}

/// Only the operator's user ends a job: a `job.abandoned` forged with billing-worker's user is
/// refused (a topic permission on `jobs`, `ops/rabbitmq/users.sh`), and the order is not
/// touched; the same event from msgctl's user is taken, and the order ends cancelled (issue 56,
/// row 5: until then any service's user could end any order).
#[tokio::test]
async fn only_the_operator_s_user_may_publish_a_job_abandoned() {
    let mut shop = least_privilege_shop().await;
    shop.kill(Service::Billing).await;
    let job_id = shop.place(&[("SKU-2", 1)]).await;
    let order_id: uuid::Uuid = shop.job(job_id).await["orderId"].as_str().and_then(|id| id.parse().ok()).expect("id");
    shop.wait_for_held_stock(order_id).await;

    let billing = format!("t-{}-billing-worker", shop.env.id());
    let forged = abandon_as(&shop, &billing, job_id).await;
    assert!(forged.is_err(), "billing-worker's user published a job.abandoned");
    let operator = format!("t-{}-msgctl", shop.env.id());
    abandon_as(&shop, &operator, job_id).await.expect("msgctl's user publishes a job.abandoned");
    // Cancelled, and compensating until billing, down, answers.
    shop.wait_for_state(job_id, "compensating").await;
    shop.restart(Service::Billing).await;
    let job = shop.wait_for_state(job_id, "cancelled").await;
    let reason = job["lastError"].as_str().unwrap_or_default();
    assert!(reason.ends_with(&format!("abandoned by {operator}")), "the operator's, not the forged one: {job}");
    shop.assert_books_balance().await;
    shop.stop().await;
}

/// No service's user may delete a shared exchange, which would drop every other service's bindings
/// to it (issue 56, row 5): only the deploy step's user configures them (decision 0030), and this
/// shop's services started on the exchanges it declared.
#[tokio::test]
async fn no_service_s_user_may_delete_a_shared_exchange() {
    let mut shop = least_privilege_shop().await;
    for service in Service::ALL {
        let user = Accounts::of(&shop.env).broker_user(service);
        let url = SecretUrl::new(as_user(&shop.env.amqp_url(), &user, None));
        let connection = messaging::runtime::broker::connect(&url, "least-privilege test").await.expect("connect");
        let channel = connection.create_channel().await.expect("channel");
        let deleted = channel.exchange_delete(shop::exchanges::ORDERS.into(), Default::default()).await;
        assert!(
            deleted.as_ref().is_err_and(messaging::topology::is_access_refused),
            "{service:?}'s user deleted `orders`: {deleted:?}"
        );
        let _ = connection.close(200, "bye".into()).await;
    }
    let job_id = shop.place(&[("SKU-1", 1)]).await;
    shop.wait_for_state(job_id, "succeeded").await;
    shop.stop().await;
}

/// A service started before the deploy step finds a shared exchange missing and may not declare
/// it: it waits, not ready, and starts once the step has run, which also binds again what the
/// exchange's deletion unbound (decision 0030).
#[tokio::test]
async fn a_service_started_before_the_deploy_step_waits_not_ready_until_it_runs() {
    let mut shop = least_privilege_shop().await;
    shop.kill(Service::Inventory).await;
    // As before the first deploy step: no `orders` exchange (and so none of its bindings).
    let connection = shop.env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    channel.exchange_delete(shop::exchanges::ORDERS.into(), Default::default()).await.expect("delete `orders`");
    let _ = connection.close(200, "bye".into()).await;

    shop.process(Service::Inventory).start();
    // Up, answering, and not ready, for as long as the step has not run.
    testkit::eventually("inventory to answer /readyz", testkit::shop::WAIT, || async {
        shop.readyz(Service::Inventory).await.ok().map(|response| response.status)
    })
    .await;
    for _ in 0..3 {
        let status = shop.readyz(Service::Inventory).await.map(|response| response.status).ok();
        assert_eq!(status, Some(503), "inventory is ready without its exchange");
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    testkit::roles::apply_topology(&shop.env, &Accounts::of(&shop.env)).await;
    shop.wait_ready(Service::Inventory).await;
    let job_id = shop.place(&[("SKU-1", 1)]).await;
    shop.wait_for_state(job_id, "succeeded").await;
    shop.stop().await;
}

#[tokio::test]
async fn a_missing_grant_stops_the_service_and_is_named() {
    let shop = least_privilege_shop().await;
    let inventory = role(&shop, "inventory");
    sqlx::query(sqlx::AssertSqlSafe(format!("revoke insert on inbox from \"{inventory}\"")))
        .execute(&shop.inventory)
        .await
        .expect("revoke");
    let user = format!("t-{}-inventory-worker", shop.env.id());
    let mut command = tokio::process::Command::new(process::binary(Service::Inventory.binary()));
    command
        .env_clear()
        .env("DATABASE_URL", as_user(&shop.env.database_url("inventory"), &inventory, None))
        .env("AMQP_URL", as_user(&shop.env.amqp_url(), &user, None))
        .env("HTTP_ADDR", format!("127.0.0.1:{}", process::free_port()))
        .env("RUST_LOG", "off");
    let output = process::run_to_exit(command, std::time::Duration::from_secs(30)).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    let line = stderr.lines().last().unwrap_or_default();
    assert!(line.contains(&format!("role {inventory} lacks INSERT on inbox")), "{line}");
    shop.stop().await;
}

/// A service creates its outbox with its first migration and grants the relay its rights after
/// its last, and the relay may start in between (every `docker compose up` races them). The relay
/// then waits for the grant, not ready, rather than exiting, and relays once the service has made
/// it.
#[tokio::test]
async fn a_relay_started_before_its_services_grant_waits_for_it_and_then_relays() {
    let mut shop = least_privilege_shop().await;
    shop.kill(Service::Relay).await;
    shop.kill(Service::Api).await;
    // The orders outbox as its service leaves it between its migrations and its grant.
    let relay = role(&shop, "relay");
    sqlx::query(sqlx::AssertSqlSafe(format!("revoke select, update, delete on outbox from \"{relay}\"")))
        .execute(&shop.orders)
        .await
        .expect("revoke");
    shop.process(Service::Relay).start();
    let orders_loop = format!("relay:{}", role(&shop, "orders"));
    testkit::eventually("the relay to say its orders loop is not ready", testkit::shop::WAIT, || async {
        let response = shop.readyz(Service::Relay).await.ok()?;
        let body = response.json();
        let failing = body["failing"].as_array()?.iter().filter_map(serde_json::Value::as_str).collect::<Vec<_>>();
        (response.status == 503 && failing == [orders_loop.as_str()]).then_some(())
    })
    .await;
    assert_eq!(shop.process(Service::Relay).check_running(), Ok(true), "the relay waits, it does not exit");

    // The orders service starts again: its migrations are done, and it grants.
    shop.restart(Service::Api).await;
    shop.wait_ready(Service::Relay).await;
    let job = shop.place(&[("SKU-1", 1)]).await;
    shop.wait_for_state(job, "succeeded").await;
    shop.stop().await;
}

#[test]
fn the_demo_broker_s_definitions_are_what_users_sh_makes() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let made = std::process::Command::new("bash")
        .arg(root.join("ops/rabbitmq/users.sh"))
        .arg("definitions")
        .output()
        .expect("run ops/rabbitmq/users.sh definitions");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let committed = std::fs::read_to_string(root.join("ops/rabbitmq/definitions.json")).expect("definitions.json");
    assert_eq!(
        String::from_utf8_lossy(&made.stdout),
        committed,
        "ops/rabbitmq/definitions.json is stale: ops/rabbitmq/users.sh definitions > ops/rabbitmq/definitions.json"
    );
}
