//! The relay against real servers: id order, only confirmed rows marked, two relays at once, and
//! a broker with nowhere to route the messages yet.

mod common;

use std::{collections::HashSet, time::Duration};

use clap::Parser;
use common::count;
use lapin::{
    options::{QueueBindOptions, QueueDeclareOptions},
    types::FieldTable,
};
use messaging::{
    outbox, outbox_relay,
    runtime::{
        db::DbTimeouts,
        metrics,
        shutdown::{self, ShutdownTrigger},
    },
    topology,
};
use shop::{InventoryReserved, OrderLine, OrderPlaced, exchanges};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool, postgres::PgConnectOptions};
use testkit::shop::{Options, WAIT};
use testkit::{TestEnv, eventually};
use uuid::Uuid;

const PROBE: &str = "probe.order-placed";

/// Insert `n` order.placed rows, `per_tx` per transaction; returns their message ids in id order.
async fn fill_outbox(pool: &PgPool, n: usize, per_tx: usize) -> Vec<Uuid> {
    let mut ids = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(per_tx) {
        let mut tx = pool.begin().await.expect("begin");
        for i in chunk {
            let body = OrderPlaced {
                order_id: Uuid::now_v7(),
                job_id: Uuid::now_v7(),
                customer_id: format!("c-{i}"),
                lines: vec![OrderLine { sku: "SKU-1".into(), quantity: 1 }],
                deadline: None,
            };
            ids.push(outbox::enqueue(&mut tx, &body, Some(body.job_id)).await.expect("enqueue"));
        }
        tx.commit().await.expect("commit");
    }
    ids
}

/// A queue that receives every order.placed, standing in for a consumer.
async fn bind_probe(env: &TestEnv) {
    let connection = env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    topology::declare_exchanges(&channel, &[exchanges::ORDERS]).await.expect("exchanges");
    channel.queue_declare(PROBE.into(), QueueDeclareOptions::durable(), FieldTable::default()).await.expect("queue");
    channel
        .queue_bind(
            PROBE.into(),
            exchanges::ORDERS.into(),
            "order.placed".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    let _ = connection.close(200, "bye".into()).await;
}

async fn start_relay(
    env: &TestEnv,
    trigger: &ShutdownTrigger,
) -> (tokio::task::JoinHandle<Result<(), messaging::service::BoxError>>, String) {
    start_relay_with(env, trigger, &[]).await
}

/// [`start_relay`] with `settings` (flag, value) in place of the test kit's.
async fn start_relay_with(
    env: &TestEnv,
    trigger: &ShutdownTrigger,
    settings: &[(&str, &str)],
) -> (tokio::task::JoinHandle<Result<(), messaging::service::BoxError>>, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let mut args = relay_args(&env.database_url("orders"), &env.amqp_url());
    for (flag, value) in settings {
        match args.iter().position(|arg| arg == flag) {
            Some(at) => args[at + 1] = (*value).to_owned(),
            None => args.extend([(*flag).to_owned(), (*value).to_owned()]),
        }
    }
    let config = relay::Config::parse_from(args);
    let task = tokio::spawn(relay::run(config, listener, trigger.subscribe()));
    testkit::wait_ready(&base, WAIT, "").await;
    (task, base)
}

async fn wait_all_published(pool: &PgPool) {
    eventually("every outbox row to be published", WAIT, || async {
        (count(pool, "select count(*) from outbox where published_at is null").await == 0).then_some(())
    })
    .await;
}

fn message_ids(deliveries: &[lapin::message::Delivery]) -> Vec<Uuid> {
    deliveries
        .iter()
        .map(|d| d.properties.message_id().as_ref().expect("message_id").as_str().parse().expect("uuid"))
        .collect()
}

#[tokio::test]
async fn relay_publishes_in_id_order_and_marks_only_confirmed_rows() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    bind_probe(&env).await;
    let expected = fill_outbox(&pool, 300, 300).await;
    let (trigger, _) = shutdown::channel();
    let (relay, _) = start_relay(&env, &trigger).await;

    wait_all_published(&pool).await;
    let delivered = message_ids(&env.drain(PROBE).await);
    assert_eq!(delivered, expected, "every row delivered once, in id order");
    assert_eq!(count(&pool, "select count(*) from outbox where attempts > 0").await, 0);
    trigger.trigger();
    relay.await.expect("relay task").expect("relay ran");
}

#[tokio::test]
async fn two_relays_together_publish_each_row_once() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    bind_probe(&env).await;
    let (trigger, _) = shutdown::channel();
    let (first, _) = start_relay(&env, &trigger).await;
    let (second, _) = start_relay(&env, &trigger).await;

    // Rows arrive while both relays are running, in many small transactions, so both get work.
    let expected = fill_outbox(&pool, 1000, 10).await;
    wait_all_published(&pool).await;
    let delivered = message_ids(&env.drain(PROBE).await);
    assert_eq!(delivered.len(), expected.len(), "no row published twice, none lost");
    let unique: HashSet<_> = delivered.iter().collect();
    assert_eq!(unique, expected.iter().collect::<HashSet<_>>());
    trigger.trigger();
    first.await.expect("relay task").expect("relay ran");
    second.await.expect("relay task").expect("relay ran");
}

#[tokio::test]
async fn rows_committed_while_the_relay_runs_are_each_published_on_a_notify_not_the_poll() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    bind_probe(&env).await;
    // Rows committed before the relay starts: its first claim must not wait for a NOTIFY.
    let mut expected = fill_outbox(&pool, 3, 3).await;
    let (trigger, _) = shutdown::channel();
    // No poll within the test: a row whose NOTIFY the relay dropped without claiming the row would
    // stay unpublished. Batches of 8, so that a burst fills some and the next claim comes at once.
    let settings = [("--poll-interval", "1h"), ("--batch-size", "8")];
    let (relay, _) = start_relay_with(&env, &trigger, &settings).await;
    wait_all_published(&pool).await;

    // A row, then a second one 0 to 7 ms behind it (landing during the first one's linger, its
    // claim or its settling), then nothing until both are published: a second row whose NOTIFY was
    // taken for the first one's claim would wait for the poll. Every fifth round the second is a
    // burst of 20, so that full batches are followed by a claim at once.
    for round in 0..40_u64 {
        expected.extend(fill_outbox(&pool, 1, 1).await);
        tokio::time::sleep(Duration::from_millis(round % 8)).await;
        let rows = if round % 5 == 4 { 20 } else { 1 };
        expected.extend(fill_outbox(&pool, rows, rows).await);
        wait_all_published(&pool).await;
    }
    let delivered = message_ids(&env.drain(PROBE).await);
    assert_eq!(delivered, expected, "every row delivered once, in id order");
    trigger.trigger();
    relay.await.expect("relay task").expect("relay ran");
}

/// Every NOTIFY the relay has received when it claims announced a row that claim sees. After a
/// burst of commits, each of its own transaction, the relay is left with many of them received and
/// unread: it must take them all for one claim, not claim once for each, with nothing due, long
/// after the burst's rows were published.
#[tokio::test]
async fn after_a_burst_the_relay_claims_once_for_the_notifies_it_has_received_not_once_for_each() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    bind_probe(&env).await;
    let (trigger, _) = shutdown::channel();
    // No poll within the test, and the shipped linger: a claim answers a NOTIFY, one at most every
    // 2 ms, while the burst below commits faster than that.
    let (relay, base) = start_relay_with(&env, &trigger, &[("--poll-interval", "1h"), ("--linger", "2ms")]).await;
    let burst = 3_000;
    let fills = (0..4).map(|_| fill_outbox(&pool, burst / 4, 1));
    let expected: usize = futures_util::future::join_all(fills).await.iter().map(Vec::len).sum();
    wait_all_published(&pool).await;

    // Nothing is due now and nothing is committed: a claim in this window answers a NOTIFY the
    // relay had received before it, for rows already published. (Two seconds of watching, not a
    // wait for a state.)
    let before = claims(&base).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = claims(&base).await - before;
    assert!(idle <= 10, "with nothing due, the relay claimed {idle} times in 2 s after the burst");
    assert_eq!(env.drain(PROBE).await.len(), expected, "every row of the burst delivered once");
    trigger.trigger();
    relay.await.expect("relay task").expect("relay ran");
}

/// The claims the relay at `base` has run (`outbox_claims_total`, its one database).
async fn claims(base: &str) -> u64 {
    let response = testkit::http::request("GET", &format!("{base}/metrics"), &[], None).await.expect("metrics");
    let text = String::from_utf8_lossy(&response.body).into_owned();
    text.lines()
        .find(|line| line.strip_prefix(metrics::OUTBOX_CLAIMS).is_some_and(|labels| labels.starts_with('{')))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .expect("outbox_claims_total in the relay's /metrics")
}

#[tokio::test]
async fn relay_started_before_any_queue_marks_nothing_then_delivers_everything() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    let expected = fill_outbox(&pool, 50, 50).await;
    let (trigger, _) = shutdown::channel();
    let (relay, base) = start_relay(&env, &trigger).await;

    // Nothing is bound to the exchange yet: every publish is returned, nothing is marked.
    eventually("every row to be returned at least once", WAIT, || async {
        (count(&pool, "select count(*) from outbox where attempts > 0 and last_error like '%NO_ROUTE%'").await == 50)
            .then_some(())
    })
    .await;
    assert_eq!(count(&pool, "select count(*) from outbox where published_at is not null").await, 0);
    let metrics = testkit::http::request("GET", &format!("{base}/metrics"), &[], None).await.expect("metrics");
    assert!(String::from_utf8_lossy(&metrics.body).contains("outbox_publish_failures_total{database="));

    bind_probe(&env).await;
    wait_all_published(&pool).await;
    let delivered: HashSet<Uuid> = message_ids(&env.drain(PROBE).await).into_iter().collect();
    assert_eq!(delivered, expected.into_iter().collect::<HashSet<_>>(), "all delivered once the queue exists");
    trigger.trigger();
    relay.await.expect("relay task").expect("relay ran");
}

#[tokio::test]
async fn in_one_batch_only_the_unroutable_rows_are_refused_and_the_others_are_marked_once() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    bind_probe(&env).await;
    // One batch where every sixth row goes to an exchange with nothing bound. The broker returns
    // those at once and confirms the others later, so a return arrives before the acks of the
    // rows sent ahead of it: it must not be taken for theirs.
    let mut tx = pool.begin().await.expect("begin");
    let mut expected = HashSet::new();
    for i in 0..480 {
        let (order_id, job_id) = (Uuid::now_v7(), Uuid::now_v7());
        let lines = vec![OrderLine { sku: "SKU-1".into(), quantity: 1 }];
        if i % 6 == 5 {
            let body = InventoryReserved { order_id, job_id, reservation_id: Uuid::now_v7(), lines, deadline: None };
            outbox::enqueue(&mut tx, &body, Some(job_id)).await.expect("enqueue");
        } else {
            let body = OrderPlaced { order_id, job_id, customer_id: format!("c-{i}"), lines, deadline: None };
            expected.insert(outbox::enqueue(&mut tx, &body, Some(job_id)).await.expect("enqueue"));
        }
    }
    tx.commit().await.expect("commit");
    let (trigger, _) = shutdown::channel();
    let (relay, _) = start_relay(&env, &trigger).await;

    eventually("every row to be marked or refused", WAIT, || async {
        (count(&pool, "select count(*) from outbox where published_at is not null or attempts > 0").await == 480)
            .then_some(())
    })
    .await;
    let refused = "select count(*) from outbox where exchange = 'orders' and attempts > 0";
    assert_eq!(count(&pool, refused).await, 0, "a delivered row taken for returned");
    let marked = "select count(*) from outbox where exchange = 'inventory' and published_at is not null";
    assert_eq!(count(&pool, marked).await, 0, "a returned row marked as published");
    let returned = "select count(*) from outbox where exchange = 'inventory' and last_error like '%NO_ROUTE%'";
    assert_eq!(count(&pool, returned).await, 80);
    let delivered = message_ids(&env.drain(PROBE).await);
    assert_eq!(delivered.len(), 400, "each routable row delivered once");
    assert_eq!(delivered.into_iter().collect::<HashSet<_>>(), expected);
    trigger.trigger();
    relay.await.expect("relay task").expect("relay ran");
}

#[tokio::test]
async fn a_relay_started_before_its_database_exists_waits_then_publishes() {
    let env = TestEnv::new().await;
    bind_probe(&env).await;
    let (trigger, _) = shutdown::channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let config = relay::Config::parse_from(relay_args(&env.database_url("orders"), &env.amqp_url()));
    let relay = tokio::spawn(relay::run(config, listener, trigger.subscribe()));

    // Not ready while the database its service creates does not exist: waiting, not failing.
    let readyz = format!("{base}/readyz");
    let waiting = eventually("the relay to answer not ready", WAIT, || async {
        let response = testkit::http::request("GET", &readyz, &[], None).await.ok()?;
        (response.status == 503).then(|| response.json())
    })
    .await;
    assert!(waiting["failing"].to_string().contains("relay:"), "{waiting}");
    assert!(!relay.is_finished(), "the relay waits; it does not give up");

    // Its service arrives: creates and migrates the database, and writes.
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    let expected = fill_outbox(&pool, 5, 5).await;
    testkit::wait_ready(&base, WAIT, "").await;
    wait_all_published(&pool).await;
    assert_eq!(message_ids(&env.drain(PROBE).await), expected);
    trigger.trigger();
    relay.await.expect("relay task").expect("relay ran");
}

/// `msgctl args` on this test's broker and orders database.
async fn msgctl(env: &TestEnv, args: &[&str]) -> (bool, String, String) {
    let output = env.msgctl(args).await;
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (output.status.success(), text(&output.stdout), text(&output.stderr))
}

#[tokio::test]
async fn msgctl_lists_the_rows_the_broker_refuses_and_retry_sends_them_at_once() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    let stuck = fill_outbox(&pool, 1, 1).await[0];
    // The relay backs off for 10 minutes after a refusal: only `retry` can get the row out in time.
    let (trigger, _) = shutdown::channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (database, amqp) = (env.database_url("orders"), env.amqp_url());
    // No queue at all: returned by the broker (no expected topology to hold it first).
    let args =
        ["relay", "--database-url", &database, "--amqp-url", &amqp, "--poll-interval", "50ms", "--topology", "none"];
    let config = relay::Config::parse_from(args.into_iter().chain(["--retry-initial", "10m", "--retry-max", "10m"]));
    let relay = tokio::spawn(relay::run(config, listener, trigger.subscribe()));
    eventually("the broker to refuse the row", WAIT, || async {
        (count(&pool, "select count(*) from outbox where attempts > 0").await == 1).then_some(())
    })
    .await;

    let (ok, stdout, stderr) = msgctl(&env, &["outbox", "stuck", "--json"]).await;
    assert!(ok, "{stderr}");
    let rows: Vec<serde_json::Value> = stdout.lines().map(|line| serde_json::from_str(line).expect("JSON")).collect();
    assert_eq!(rows.len(), 1, "{stdout}");
    assert_eq!(rows[0]["messageId"], stuck.to_string());
    assert_eq!(rows[0]["exchange"], "orders");
    assert!(rows[0]["lastError"].as_str().is_some_and(|error| error.contains("NO_ROUTE")), "{stdout}");

    // Unknown ids and an empty selection are refused, in one line, changing nothing.
    let unknown = Uuid::now_v7();
    let (ok, _, stderr) = msgctl(&env, &["outbox", "retry", &unknown.to_string()]).await;
    assert!(!ok && stderr.trim().ends_with(&unknown.to_string()) && stderr.lines().count() == 1, "{stderr}");

    // The cause is fixed (a queue is bound), then the row is retried now, not in 10 minutes.
    bind_probe(&env).await;
    let (ok, stdout, stderr) = msgctl(&env, &["outbox", "retry", &stuck.to_string()]).await;
    assert!(ok && stdout.contains("1 row(s) due now"), "{stdout}{stderr}");
    wait_all_published(&pool).await;
    assert_eq!(message_ids(&env.drain(PROBE).await), [stuck]);
    let (ok, stdout, _) = msgctl(&env, &["outbox", "stuck"]).await;
    assert!(ok && stdout.contains("0 stuck row(s)"), "{stdout}");
    let (ok, _, stderr) = msgctl(&env, &["outbox", "retry", "--all"]).await;
    assert!(!ok && stderr.contains("nothing selected"), "{stderr}");
    trigger.trigger();
    relay.await.expect("relay task").expect("relay ran");
}

/// The relay's flags here: the test kit's, and no expected topology, since a queue of the test's
/// own stands in for the shop's consumers of `order.placed`.
fn relay_args(databases: &str, amqp: &str) -> Vec<String> {
    let mut args = vec!["relay".to_owned()];
    args.extend(Options::relay_flags(databases, amqp));
    args.extend(["--topology".to_owned(), "none".to_owned()]);
    args
}

/// Every row the relay marks leaves a dead entry in the index of unpublished rows until a vacuum.
/// On the relay's sessions ([`relay::session_options`]) the claim walks that index, and a walk
/// marks each dead entry it passes as dead, so the next claim skips it. A bitmap scan or a
/// sequential scan, the planner's choices here with the default settings, marks nothing: each
/// claim reads the table page of every row published since the last vacuum. (The marks also wait
/// until no snapshot on the server can see the rows, which a busy test server does not promise, so
/// the test checks the plans, not the marks.)
#[tokio::test]
async fn on_the_relays_sessions_the_claim_walks_the_index_where_the_default_plan_does_not() {
    let env = TestEnv::new().await;
    let pool = env.messaging_pool("claim").await;
    // No analyze of its own changes the statistics the planner goes by.
    sqlx::query("alter table outbox set (autovacuum_enabled = off)").execute(&pool).await.expect("autovacuum off");
    // Stored out of id order, as rows are once marks have moved them about the table: the planner
    // then expects a walk in id order to jump between pages.
    sqlx::query(
        "insert into outbox (id, message_id, message_type, exchange, routing_key, payload) overriding system value
         select id, gen_random_uuid(), 'probe', 'probe', 'probe', '{}'
           from generate_series(1, 20000) id order by random()",
    )
    .execute(&pool)
    .await
    .expect("fill the outbox");
    let ids: Vec<i64> = sqlx::query_scalar("select id from outbox order by id").fetch_all(&pool).await.expect("ids");
    // Analyzed while a few hundred rows wait, as a busy outbox is: the planner then expects about
    // that many unpublished rows.
    let (earlier, last) = ids.split_at(ids.len() - 300);
    let mut conn = pool.acquire().await.expect("connection");
    outbox_relay::mark_published(&mut conn, earlier).await.expect("mark rows published");
    sqlx::query("analyze outbox").execute(&mut *conn).await.expect("analyze");
    outbox_relay::mark_published(&mut conn, last).await.expect("mark the rest published");

    let default = claim_search(&mut conn).await;
    let planned = scans(&default);
    assert!(
        planned.iter().any(|scan| scan.starts_with("Bitmap Heap Scan") || scan.starts_with("Seq Scan")),
        "the default plan walks the index ({planned:?}): not the case tested: {default}"
    );
    let options: PgConnectOptions = env.database_url("claim").parse().expect("options");
    let mut relay = relay::session_options(options, &DbTimeouts::default()).connect().await.expect("a relay's session");
    let walked = claim_search(&mut relay).await;
    let expected = ["Index Scan using outbox_unpublished"];
    assert_eq!(scans(&walked), expected, "the relay's claim does not walk the index: {walked}");
}

/// The plan (`EXPLAIN ANALYZE`, rolled back) of the claim's search for due rows on `conn`: its
/// `due` part (how the claimed rows are then fetched is the planner's choice by their number).
async fn claim_search(conn: &mut PgConnection) -> serde_json::Value {
    let mut tx = conn.begin().await.expect("begin");
    let explain = format!("explain (analyze, buffers, format json) {}", outbox_relay::CLAIM);
    let plan: serde_json::Value =
        sqlx::query_scalar(sqlx::AssertSqlSafe(explain)).bind(2048_i64).fetch_one(&mut *tx).await.expect("explain");
    tx.rollback().await.expect("rollback");
    plan[0]["Plan"]["Plans"]
        .as_array()
        .expect("the claim's parts")
        .iter()
        .find(|part| part["Subplan Name"] == "CTE due")
        .expect("the search for due rows")
        .clone()
}

/// The scans of the outbox in `plan`, outermost first: `Index Scan using <index>`, `Bitmap Heap
/// Scan`, `Seq Scan`.
fn scans(plan: &serde_json::Value) -> Vec<String> {
    let mut found = Vec::new();
    let node = plan["Node Type"].as_str().unwrap_or_default();
    if node.ends_with("Scan") && plan["Relation Name"] == "outbox" {
        found.push(match plan["Index Name"].as_str() {
            Some(index) => format!("{node} using {index}"),
            None => node.to_owned(),
        });
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        found.extend(scans(child));
    }
    found
}
