//! `msgctl parked redrive` on the real shop, as processes: a quarantined order comes back and
//! succeeds once while the other parked messages keep their place; a copy already applied is
//! skipped by the inbox; and a redrive killed half-way loses nothing. Without `--endpoint`, msgctl
//! finds the parking queues through the management API.

use std::process::Output;

use chrono::Utc;
use lapin::{BasicProperties, types::AMQPValue};
use messaging::{envelope, publisher::Publisher};
use serde_json::Value;
use testkit::{
    TestEnv, eventually, process,
    shop::{Options, Service, Shop, WAIT},
};
use tokio::io::{AsyncBufReadExt, BufReader};
use uuid::Uuid;

const INVENTORY: &str = "inventory.order-placed";

async fn msgctl(env: &TestEnv, args: &[&str]) -> Output {
    tokio::process::Command::new(process::binary("msgctl"))
        .env("AMQP_URL", env.amqp_url())
        .env("RABBITMQ_MANAGEMENT_URL", env.management_url())
        .args(args)
        .output()
        .await
        .expect("run msgctl")
}

/// `msgctl parked list --json` of inventory's parking: each message's job id, in parking order.
async fn parked_jobs(env: &TestEnv) -> Vec<Uuid> {
    listed_jobs(env, &["parked", "list", "--endpoint", INVENTORY, "--json"]).await
}

/// The job ids `msgctl args` lists, one JSON object per line.
async fn listed_jobs(env: &TestEnv, args: &[&str]) -> Vec<Uuid> {
    let output = msgctl(env, args).await;
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            let message: Value = serde_json::from_str(line).expect("one JSON object per line");
            message["jobId"].as_str().and_then(|id| id.parse().ok()).expect("jobId")
        })
        .collect()
}

async fn count(pool: &sqlx::PgPool, sql: &str, order_job: Uuid) -> i64 {
    sqlx::query_scalar(sql).bind(order_job).fetch_one(pool).await.expect(sql)
}

#[tokio::test]
async fn a_quarantined_order_is_redriven_once_the_fault_clears_and_the_rest_stay_parked_in_order() {
    // Two attempts: FLAKY-1 (fails on attempts 1 and 2) is parked like POISON-1.
    let options = Options { demo_faults: true, max_attempts: 2, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let first = shop.place(&[("POISON-1", 1)]).await;
    let flaky = shop.place(&[("FLAKY-1", 1)]).await;
    let last = shop.place(&[("POISON-1", 1)]).await;
    for job in [first, flaky, last] {
        shop.wait_for_state(job, "quarantined").await;
    }
    let before = parked_jobs(&shop.env).await;
    assert_eq!(before.len(), 3, "{before:?}");
    // Without --endpoint, every parking queue of the vhost (found through the management API):
    // the same three, billing's and the status consumer's being empty.
    assert_eq!(listed_jobs(&shop.env, &["parked", "list", "--json"]).await, before);
    let output = tokio::process::Command::new(process::binary("msgctl"))
        .env("AMQP_URL", shop.env.amqp_url())
        .env("RABBITMQ_MANAGEMENT_URL", "http://guest:guest@127.0.0.1:9")
        .args(["parked", "list"])
        .output()
        .await
        .expect("run msgctl");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.lines().count() == 1, "{output:?}");
    assert!(
        stderr.contains("management API at http://guest:***@127.0.0.1:9") && stderr.contains("--endpoint"),
        "{stderr}"
    );

    // A dry run changes nothing.
    let output =
        msgctl(&shop.env, &["parked", "redrive", "--endpoint", INVENTORY, "--reason", "FLAKY", "--dry-run"]).await;
    assert!(output.status.success(), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("1 message(s) would be redriven"), "{output:?}");
    assert_eq!(parked_jobs(&shop.env).await, before, "a dry run moves nothing");
    assert_eq!(shop.job(flaky).await["state"], "quarantined");

    // The fault clears (a fixed release of both workers), then the FLAKY order is redriven.
    for service in [Service::Inventory, Service::Billing] {
        shop.kill(service).await;
        shop.restart_with(service, &[("DEMO_FAULTS", "false")]).await;
    }
    let output = msgctl(&shop.env, &["parked", "redrive", "--endpoint", INVENTORY, "--reason", "FLAKY"]).await;
    assert!(output.status.success(), "{output:?}");

    let job = shop.wait_for_state(flaky, "succeeded").await;
    assert!(job["resultKey"].is_string(), "{job}");
    let invoices = count(&shop.billing, "select count(*) from invoices where job_id = $1", flaky).await;
    assert_eq!(invoices, 1, "invoiced once");
    let reservations = count(&shop.inventory, "select count(*) from reservations where job_id = $1", flaky).await;
    assert_eq!(reservations, 1, "reserved once");
    let others: Vec<Uuid> = before.iter().copied().filter(|job| *job != flaky).collect();
    assert_eq!(parked_jobs(&shop.env).await, others, "the other parked messages stay, in their order");
    assert_eq!(shop.job(first).await["state"], "quarantined");
}

/// Park a copy of `message_id` (an `order.placed` already applied), as the broker would after the
/// commit: same id, body and job, with the parking headers.
async fn park_a_copy(shop: &Shop, message_id: Uuid) {
    let (payload, job_id): (sqlx::types::Json<Value>, Uuid) = sqlx::query_as(
        "select o.payload, j.id from outbox o join jobs j on j.order_placed_message_id = o.message_id
          where o.message_id = $1",
    )
    .bind(message_id)
    .fetch_one(&shop.orders)
    .await
    .expect("the order.placed row");
    let properties: BasicProperties =
        envelope::Headers::raw(Some(job_id), 1).properties(message_id, "order.placed", Utc::now());
    let parked = envelope::with_headers(
        &properties,
        &[
            (envelope::HEADER_LAST_ERROR, envelope::string_value("dead-lettered by the broker (delivery_limit)")),
            (envelope::HEADER_ENDPOINT, envelope::string_value(INVENTORY)),
            (envelope::HEADER_PARKED_AT, envelope::string_value(&Utc::now().to_rfc3339())),
            (envelope::HEADER_RETRY_COUNT, AMQPValue::LongLongInt(0)),
        ],
    );
    let connection = shop.env.amqp().await;
    let publisher = Publisher::open(&connection).await.expect("publisher");
    let body = serde_json::to_vec(&payload.0).expect("json");
    publisher.publish("", &format!("{INVENTORY}.parking"), &body, parked).await.expect("parked");
    let _ = connection.close(200, "bye".into()).await;
}

#[tokio::test]
async fn a_parked_copy_of_an_applied_message_is_redriven_and_skipped_by_the_inbox() {
    let mut shop = Shop::start(Options::default()).await;
    let job = shop.place(&[("SKU-2", 3)]).await;
    shop.wait_for_state(job, "succeeded").await;
    let message_id: Uuid = sqlx::query_scalar("select order_placed_message_id from jobs where id = $1")
        .bind(job)
        .fetch_one(&shop.orders)
        .await
        .expect("job");
    park_a_copy(&shop, message_id).await;

    let output = msgctl(&shop.env, &["parked", "redrive", "--endpoint", INVENTORY]).await;
    assert!(output.status.success(), "{output:?}");
    let series = "inbox_duplicates_skipped_total{endpoint=\"inventory.order-placed\"}";
    eventually("the inbox to skip the redriven copy", WAIT, || async {
        (shop.metric(Service::Inventory, series).await == 1).then_some(())
    })
    .await;
    assert_eq!(count(&shop.inventory, "select count(*) from reservations where job_id = $1", job).await, 1);
    assert_eq!(shop.job(job).await["state"], "succeeded", "a redrive does not move a job that ended well");
    assert!(parked_jobs(&shop.env).await.is_empty());
    shop.assert_books_balance().await;
}

#[tokio::test]
async fn a_redrive_killed_between_publish_and_ack_leaves_every_message_parked_or_in_the_work_queue() {
    let options = Options { demo_faults: true, max_attempts: 1, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let jobs = [shop.place(&[("POISON-1", 1)]).await, shop.place(&[("POISON-1", 2)]).await];
    for job in jobs {
        shop.wait_for_state(job, "quarantined").await;
    }
    let before = parked_jobs(&shop.env).await;
    // Nobody consumes the work queue: what is redriven stays there to be counted.
    shop.kill(Service::Inventory).await;

    let mut redrive = tokio::process::Command::new(process::binary("msgctl"))
        .env("AMQP_URL", shop.env.amqp_url())
        .env("FAILPOINTS", "msgctl.after-redrive-publish")
        .args(["parked", "redrive", "--endpoint", INVENTORY])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn msgctl");
    let mut stderr = BufReader::new(redrive.stderr.take().expect("stderr")).lines();
    let reached = tokio::time::timeout(WAIT, async {
        while let Some(line) = stderr.next_line().await.expect("read stderr") {
            if line.contains("FAILPOINT msgctl.after-redrive-publish reached") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(reached, Ok(true), "msgctl reached its failpoint");
    redrive.kill().await.expect("kill -9 msgctl");

    // The first message is in both places; nothing is in neither.
    assert_eq!(eventually_parked(&shop.env, before.len()).await, before, "all still parked, in order");
    let copies = shop.env.drain(INVENTORY).await;
    let copied: Vec<Option<Uuid>> = copies.iter().map(|copy| envelope::correlation_id(&copy.properties)).collect();
    assert_eq!(copied, [Some(before[0])], "the first one's copy is in the work queue");
}

/// The parked jobs once `expected` messages are back in parking (the broker returns a dead
/// client's unacked messages when it notices the connection is gone).
async fn eventually_parked(env: &TestEnv, expected: usize) -> Vec<Uuid> {
    eventually("the killed client's messages to be back in parking", WAIT, || async {
        let parked = parked_jobs(env).await;
        (parked.len() == expected).then_some(parked)
    })
    .await
}

#[tokio::test]
async fn a_redrive_the_broker_refuses_leaves_the_message_parked_and_its_job_quarantined() {
    let options = Options { demo_faults: true, max_attempts: 1, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let job = shop.place(&[("POISON-1", 1)]).await;
    shop.wait_for_state(job, "quarantined").await;
    // The work queue is gone (and its worker with it): the copy has nowhere to go.
    shop.kill(Service::Inventory).await;
    let connection = shop.env.amqp().await;
    let channel = connection.create_channel().await.expect("channel");
    channel.queue_delete(INVENTORY.into(), lapin::options::QueueDeleteOptions::default()).await.expect("delete");
    let _ = connection.close(200, "bye".into()).await;

    let output = msgctl(&shop.env, &["parked", "redrive", "--endpoint", INVENTORY]).await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot send"), "{output:?}");
    assert_eq!(parked_jobs(&shop.env).await, [job], "still parked");
    // job.redriven, then job.quarantined again: once the status consumer has applied both, the job
    // is where it was, not waiting for a message that will not come.
    let applied = "select count(*) filter (where message_type = 'job.redriven') * 10
                        + count(*) filter (where message_type = 'job.quarantined') from inbox";
    eventually("the status consumer to apply both events", WAIT, || async {
        let seen: i64 = sqlx::query_scalar(applied).fetch_one(&shop.orders).await.expect("inbox");
        (seen == 12).then_some(())
    })
    .await;
    assert_eq!(shop.job(job).await["state"], "quarantined");
}
