//! `msgctl parked redrive` on the real shop, as processes: a quarantined order comes back and
//! succeeds once while the other parked messages keep their place; a copy already applied is
//! skipped by the inbox; and a redrive killed half-way loses nothing. Without `--endpoint`, msgctl
//! finds the parking queues through the management API.

use chrono::Utc;
use lapin::types::AMQPValue;
use messaging::{envelope, runtime::failpoint};
use serde_json::Value;
use testkit::{
    TestEnv, eventually, http, process,
    shop::{Options, Service, Shop, WAIT},
};
use uuid::Uuid;

const INVENTORY: &str = "inventory.order-placed";

/// `msgctl parked list --json` of inventory's parking: each message's job id, in parking order.
async fn parked_jobs(env: &TestEnv) -> Vec<Uuid> {
    listed_jobs(env, &["parked", "list", "--endpoint", INVENTORY, "--json"]).await
}

/// The job ids `msgctl args` lists, one JSON object per line.
async fn listed_jobs(env: &TestEnv, args: &[&str]) -> Vec<Uuid> {
    let output = env.msgctl(args).await;
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            let message: Value = serde_json::from_str(line).expect("one JSON object per line");
            message["jobId"].as_str().and_then(|id| id.parse().ok()).expect("jobId")
        })
        .collect()
}

async fn count(pool: &sqlx::PgPool, sql: &'static str, order_job: Uuid) -> i64 {
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
    // The live page counts them in the shop's vhost (it read `/`'s, whatever AMQP_URL named).
    let operator = testkit::auth::bearer(&testkit::auth::operator());
    eventually("the live page to count the parked messages", WAIT, || async {
        let url = format!("{}/overview", shop.front());
        let overview = http::request("GET", &url, &[("Authorization", &operator)], None).await.expect("GET").json();
        let parking = overview["parking"].as_array().cloned().unwrap_or_default();
        let depth = parking.iter().find(|queue| queue["queue"] == format!("{INVENTORY}.parking"));
        (depth.map(|queue| queue["messages"].clone()) == Some(Value::from(3))).then_some(())
    })
    .await;
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
        shop.env.msgctl(&["parked", "redrive", "--endpoint", INVENTORY, "--reason", "FLAKY", "--dry-run"]).await;
    assert!(output.status.success(), "{output:?}");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(said.contains("1 message(s) would be redriven"), "{output:?}");
    // Its consumer's inbox has it not: a copy would apply.
    assert!(said.contains(&format!("would redrive {INVENTORY}  ")) && said.contains("[will apply]"), "{said}");
    assert_eq!(parked_jobs(&shop.env).await, before, "a dry run moves nothing");
    assert_eq!(shop.job(flaky).await["state"], "quarantined");

    // The fault clears (a fixed release of both workers), then the FLAKY order is redriven.
    for service in [Service::Inventory, Service::Billing] {
        shop.kill(service).await;
        shop.restart_with(service, &[("DEMO_FAULTS", "false")]).await;
    }
    let output = shop.env.msgctl(&["parked", "redrive", "--endpoint", INVENTORY, "--reason", "FLAKY"]).await;
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

    // Its story: the failed try and its wait, the park and why, the redrive, then through.
    let story = shop.wait_for_story(flaky, "ended").await;
    let events = story["events"].as_array().expect("events");
    let step = |kind: &str| -> &Value {
        let mut found = events.iter().filter(|event| event["kind"] == kind);
        let event = found.next().unwrap_or_else(|| panic!("no {kind}: {story}"));
        assert!(found.next().is_none(), "one {kind}: {story}");
        event
    };
    let retry = step("retry_scheduled");
    assert_eq!((&retry["endpoint"], &retry["attempt"]), (&Value::from(INVENTORY), &Value::from(1)), "{story}");
    // When its next attempt was due (the test's retry waits are short: often before `at`, when the
    // status consumer applied the event).
    let due = retry["dueAt"].as_str().and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok());
    assert!(due.is_some() && retry["detail"].is_string(), "{story}");
    let parked = step("parked");
    assert_eq!((&parked["endpoint"], &parked["attempt"]), (&Value::from(INVENTORY), &Value::from(2)), "{story}");
    assert_eq!(step("redriven")["detail"], "redrive 1");
    assert_eq!(step("ended")["detail"], "succeeded");
    let kinds: Vec<&str> = events.iter().filter_map(|event| event["kind"].as_str()).collect();
    let after_publish: Vec<&str> = kinds.iter().copied().filter(|kind| *kind != "published").collect();
    assert_eq!(after_publish, ["accepted", "retry_scheduled", "parked", "redriven", "reserved", "invoiced", "ended"]);
}

/// The live page's console (`/parked`) runs msgctl's implementation over HTTP: for operators
/// only; a selection of nothing, or of an endpoint the broker does not have, refused, nothing
/// changed; a dry run that reads inventory's inbox
/// and moves nothing; once the fault is lifted, a redrive, and the job succeeds.
#[tokio::test]
async fn the_console_lists_judges_and_redrives_a_parked_message_for_operators_only() {
    let options = Options { demo_faults: true, max_attempts: 1, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let job = shop.place(&[("POISON-1", 1)]).await;
    shop.wait_for_state(job, "quarantined").await;
    let operator = testkit::auth::bearer(&testkit::auth::operator());
    let customer = testkit::auth::bearer(&testkit::auth::customer("chaos"));
    let front = shop.front();
    let console = |method: &'static str, path: &'static str, token: Option<String>, body: Option<String>| {
        let url = format!("{front}{path}");
        async move {
            let mut headers = vec![("Content-Type", "application/json".to_owned())];
            headers.extend(token.map(|token| ("Authorization", token)));
            let headers: Vec<(&str, &str)> = headers.iter().map(|(name, value)| (*name, value.as_str())).collect();
            http::request(method, &url, &headers, body.as_deref()).await.expect("the console answers")
        }
    };
    assert_eq!(console("GET", "/parked", None, None).await.status, 401);
    assert_eq!(console("GET", "/parked", Some(customer.clone()), None).await.status, 403);

    let parked = console("GET", "/parked", Some(operator.clone()), None).await;
    assert_eq!(parked.status, 200, "{}", String::from_utf8_lossy(&parked.body));
    let parked = parked.json();
    let groups = parked["groups"].as_array().expect("groups");
    let [group] = groups.as_slice() else { panic!("one group: {parked}") };
    assert_eq!(group["endpoint"], INVENTORY);
    let [message] = group["messages"].as_array().expect("messages").as_slice() else { panic!("one: {parked}") };
    assert_eq!(message["summary"]["jobId"], job.to_string());
    assert_eq!(message["verdict"], "will_apply", "inventory's inbox has it not");
    assert!(message["details"]["body"].as_str().is_some_and(|body| body.contains("POISON-1")), "{message}");
    let message_id = message["summary"]["messageId"].as_str().expect("messageId").to_owned();

    let selection = |ids: &str, extra: &str| format!(r#"{{"endpoint":"{INVENTORY}","messageIds":[{ids}]{extra}}}"#);
    let quoted = format!("\"{message_id}\"");
    for bad in [selection("", ""), selection(&quoted, r#","dryRun":"yes""#), selection(&quoted, r#","typo":1"#)] {
        let refused = console("POST", "/parked/redrive", Some(operator.clone()), Some(bad.clone())).await;
        assert_eq!(refused.status, 400, "{bad}: {}", String::from_utf8_lossy(&refused.body));
    }
    let refused = console("POST", "/parked/purge", Some(customer), Some(selection(&quoted, ""))).await;
    assert_eq!(refused.status, 403);
    // An endpoint with no parking queue: the broker's refusal, naming it, and nothing done.
    let unknown = format!(r#"{{"endpoint":"no.such-endpoint","messageIds":[{quoted}]}}"#);
    let refused = console("POST", "/parked/redrive", Some(operator.clone()), Some(unknown)).await;
    let said = String::from_utf8_lossy(&refused.body);
    assert_eq!(refused.status, 502, "{said}");
    assert!(said.contains("no.such-endpoint.parking"), "{said}");
    assert_eq!(parked_jobs(&shop.env).await, [job], "nothing changed");

    let dry = console("POST", "/parked/redrive", Some(operator.clone()), Some(selection(&quoted, r#","dryRun":true"#)));
    let dry = dry.await.json();
    assert_eq!(
        (&dry["done"][0]["action"], &dry["done"][0]["verdict"]),
        (&Value::from("would redrive"), &Value::from("will_apply")),
        "{dry}"
    );
    assert_eq!(dry["error"], Value::Null, "{dry}");
    assert_eq!(parked_jobs(&shop.env).await, [job], "a dry run moves nothing");
    assert_eq!(shop.job(job).await["state"], "quarantined");

    for service in [Service::Inventory, Service::Billing] {
        shop.kill(service).await;
        shop.restart_with(service, &[("DEMO_FAULTS", "false")]).await;
    }
    let done = console("POST", "/parked/redrive", Some(operator.clone()), Some(selection(&quoted, ""))).await.json();
    assert_eq!(done["done"][0]["action"], "redriven", "{done}");
    shop.wait_for_state(job, "succeeded").await;
    let parked = console("GET", "/parked", Some(operator.clone()), None).await.json();
    assert_eq!(parked["groups"], serde_json::json!([]), "{parked}");
    // Redriven already: nothing of the selection is parked.
    let again = console("POST", "/parked/redrive", Some(operator), Some(selection(&quoted, ""))).await;
    assert_eq!(again.status, 404, "{}", String::from_utf8_lossy(&again.body));
}

/// The headers the runtime gives a message it parks at `endpoint` for `reason`, parked now.
fn parking_headers(endpoint: &str, reason: &str) -> [(&'static str, AMQPValue); 4] {
    [
        (envelope::HEADER_LAST_ERROR, envelope::string_value(reason)),
        (envelope::HEADER_ENDPOINT, envelope::string_value(endpoint)),
        (envelope::HEADER_PARKED_AT, envelope::string_value(&Utc::now().to_rfc3339())),
        (envelope::HEADER_RETRY_COUNT, AMQPValue::LongLongInt(0)),
    ]
}

/// Park a copy of the job's `order.placed` (already applied), as the runtime would after the
/// commit: same id, body and job, with the parking headers.
async fn park_a_copy(shop: &Shop, job_id: Uuid) {
    let headers = parking_headers(INVENTORY, "dead-lettered by the broker (delivery_limit)");
    shop.copy_order_placed(job_id, &format!("{INVENTORY}.parking"), &headers).await;
}

#[tokio::test]
async fn a_parked_copy_of_an_applied_message_is_redriven_and_skipped_by_the_inbox() {
    let mut shop = Shop::start(Options::default()).await;
    let job = shop.place(&[("SKU-2", 3)]).await;
    shop.wait_for_state(job, "succeeded").await;
    park_a_copy(&shop, job).await;

    // The dry run reads inventory's inbox: applied, so the copy will be skipped.
    let output = shop.env.msgctl(&["parked", "redrive", "--endpoint", INVENTORY, "--dry-run"]).await;
    assert!(output.status.success(), "{output:?}");
    let said = String::from_utf8_lossy(&output.stdout);
    assert!(said.contains("[already applied: will be skipped]"), "{said}");

    let output = shop.env.msgctl(&["parked", "redrive", "--endpoint", INVENTORY]).await;
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
    // Nobody consumes the work queue: what is redriven stays there to be counted. A graceful stop,
    // not `kill -9`: a job reads `quarantined` once its event is confirmed, a moment before its
    // original is acked, and a kill in that moment puts the original back in the work queue.
    let stopped = shop.process(Service::Inventory).terminate(WAIT).await;
    assert!(stopped.is_some_and(|status| status.success()), "inventory stops cleanly: {stopped:?}");

    redrive_killed_at(&shop.env, "msgctl.after-redrive-publish").await;

    // The first message is in both places; nothing is in neither.
    assert_eq!(eventually_parked(&shop.env, before.len()).await, before, "all still parked, in order");
    let copies = shop.env.drain(INVENTORY).await;
    let copied: Vec<Option<Uuid>> = copies.iter().map(|copy| envelope::correlation_id(&copy.properties)).collect();
    assert_eq!(copied, [Some(before[0])], "the first one's copy is in the work queue");
}

/// Run `msgctl parked redrive` on inventory's parking and `kill -9` it at `failpoint`.
async fn redrive_killed_at(env: &TestEnv, failpoint: &str) {
    let report = std::env::temp_dir().join(format!("msgctl-{}.failpoints", Uuid::new_v4()));
    let mut redrive = tokio::process::Command::new(process::binary("msgctl"))
        .env("AMQP_URL", env.amqp_url())
        .env("FAILPOINTS", failpoint)
        .env("FAILPOINTS_REPORT", &report)
        .args(["parked", "redrive", "--endpoint", INVENTORY])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn msgctl");
    eventually(&format!("msgctl at {failpoint}"), WAIT, || async {
        (failpoint::hits(&report, failpoint) >= 1).then_some(())
    })
    .await;
    redrive.kill().await.expect("kill -9 msgctl");
    let _ = std::fs::remove_file(&report);
}

#[tokio::test]
async fn a_redrive_killed_between_its_copy_and_its_job_event_ends_the_job_as_the_copy_goes() {
    // Two attempts: FLAKY-1 (fails on attempts 1 and 2) is parked; then the fault clears.
    let options = Options { demo_faults: true, max_attempts: 2, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let job = shop.place(&[("FLAKY-1", 1)]).await;
    shop.wait_for_state(job, "quarantined").await;
    for service in [Service::Inventory, Service::Billing] {
        shop.kill(service).await;
        shop.restart_with(service, &[("DEMO_FAULTS", "false")]).await;
    }

    redrive_killed_at(&shop.env, "msgctl.between-redrive-sends").await;

    // The status consumer never hears of the redrive; the copy's result ends the job anyway, and
    // its order with it. (Sending job.redriven first, as msgctl did, left the job `published`
    // for good, its message back in parking and no copy sent: found by docs/model/jobs.pml.)
    shop.wait_for_state(job, "succeeded").await;
    assert_eq!(shop.order_status(job).await, "invoiced");
    let invoices = count(&shop.billing, "select count(*) from invoices where job_id = $1", job).await;
    assert_eq!(invoices, 1, "invoiced once");
    // The original is back in parking: a copy already applied, which a later redrive's inbox skips.
    assert_eq!(eventually_parked(&shop.env, 1).await, [job]);
}

#[tokio::test]
async fn redriving_a_copy_already_applied_leaves_a_job_quarantined_by_another_step_quarantined() {
    // Inventory runs clean; billing parks POISON-1 at its only attempt: the job is quarantined by
    // billing's message, which was never applied.
    let options = Options { max_attempts: 1, ..Options::default() };
    let mut shop = Shop::start(options).await;
    shop.kill(Service::Billing).await;
    shop.restart_with(Service::Billing, &[("DEMO_FAULTS", "true")]).await;
    let job = shop.place(&[("POISON-1", 1)]).await;
    shop.wait_for_state(job, "quarantined").await;
    assert_eq!(shop.env.queue_depth("billing.inventory-reserved.parking").await, Some(1));

    // Inventory's message, applied, is also dead-lettered by the broker (its ack lost until the
    // delivery limit): the runtime parks that copy too.
    shop.copy_order_placed(job, &format!("{INVENTORY}.dead-lettered"), &[]).await;
    assert_eq!(eventually_parked(&shop.env, 1).await, [job]);
    let orders = shop.orders.clone();
    let applied = |event: &'static str| {
        let orders = orders.clone();
        async move {
            let sql = "select count(*) from inbox where message_type = $1";
            sqlx::query_scalar::<_, i64>(sql).bind(event).fetch_one(&orders).await.expect("inbox")
        }
    };
    eventually("both quarantines applied", WAIT, || async { (applied("job.quarantined").await == 2).then_some(()) })
        .await;

    // The operator redrives inventory's copy: its inbox skips it, and job.redriven must not reopen
    // a job whose billing message is still parked (it did: the job stayed `published` for good).
    let output = shop.env.msgctl(&["parked", "redrive", "--endpoint", INVENTORY]).await;
    assert!(output.status.success(), "{output:?}");
    eventually("the redrive applied", WAIT, || async { (applied("job.redriven").await == 1).then_some(()) }).await;
    let series = "inbox_duplicates_skipped_total{endpoint=\"inventory.order-placed\"}";
    eventually("inventory's inbox to skip the copy", WAIT, || async {
        (shop.metric(Service::Inventory, series).await == 1).then_some(())
    })
    .await;
    assert_eq!(shop.job(job).await["state"], "quarantined");
    assert_eq!(shop.order_status(job).await, "failed");
    assert_eq!(shop.env.queue_depth("billing.inventory-reserved.parking").await, Some(1));
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

    // The status consumer is away too: any job event sent waits in its queue, to be counted.
    shop.kill(Service::Api).await;

    let output = shop.env.msgctl(&["parked", "redrive", "--endpoint", INVENTORY]).await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot send"), "{output:?}");
    assert_eq!(parked_jobs(&shop.env).await, [job], "still parked");
    // Nothing was sent, so the job stays as it was: no job.redriven for a copy that never left.
    assert_eq!(shop.env.queue_depth("orders.status").await, Some(0), "no job event sent");
    let state: String = sqlx::query_scalar("select state from jobs where id = $1")
        .bind(job)
        .fetch_one(&shop.orders)
        .await
        .expect("job");
    assert_eq!(state, "quarantined");
}

/// An undo (`order.ended` parked at billing) is never purged nor abandoned: both are refused,
/// naming it, and nothing is ended, not even the other messages the command selects (issue 56,
/// row 7: deleted, it would leave its job `compensating` for good). A purge that selects no undo
/// goes on, and one that names `--including-undos` deletes it.
#[tokio::test]
async fn purge_and_abandon_refuse_to_delete_an_undo_and_end_nothing() {
    let options = Options { demo_faults: true, max_attempts: 1, ..Options::default() };
    let mut shop = Shop::start(options).await;
    let job = shop.place(&[("POISON-1", 1)]).await;
    shop.wait_for_state(job, "quarantined").await;
    let order_id = shop.job(job).await["orderId"].as_str().expect("orderId").to_owned();
    let cancelled = shop.cancel(&order_id).await;
    assert_eq!(cancelled.status, 202, "{}", String::from_utf8_lossy(&cancelled.body));
    shop.wait_for_state(job, "cancelled").await;
    // Its order.ended parked at billing, as the runtime parks a message it gave up on.
    const BILLING: &str = "billing.inventory-reserved";
    let headers = parking_headers(BILLING, "gave up after 1 attempts: the database said no");
    shop.copy_sent(job, "order.ended", &format!("{BILLING}.parking"), &headers).await;
    let parked_at = |endpoint: &'static str| {
        let env = &shop.env;
        async move { listed_jobs(env, &["parked", "list", "--endpoint", endpoint, "--json"]).await }
    };
    assert_eq!(parked_at(INVENTORY).await, [job], "its order.placed, parked by POISON-1");
    assert_eq!(parked_at(BILLING).await, [job]);

    for args in [
        &["parked", "abandon", "--job", &job.to_string()][..],
        &["parked", "purge", "--endpoint", BILLING, "--yes"],
        &["parked", "purge", "--endpoint", INVENTORY, "--endpoint", BILLING, "--yes"],
    ] {
        let refused = shop.env.msgctl(args).await;
        let said = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "{args:?}: {refused:?}");
        assert!(said.contains("1 undo message(s)") && said.contains("order.ended"), "{args:?}: {said}");
        assert_eq!(parked_at(INVENTORY).await, [job], "{args:?} ended nothing");
        assert_eq!(parked_at(BILLING).await, [job], "{args:?} ended nothing");
    }

    // Without the undo in its selection, a purge goes on.
    let purged = shop.env.msgctl(&["parked", "purge", "--endpoint", INVENTORY, "--yes"]).await;
    assert!(purged.status.success(), "{purged:?}");
    assert!(parked_at(INVENTORY).await.is_empty());
    assert_eq!(parked_at(BILLING).await, [job]);
    assert_eq!(shop.job(job).await["state"], "cancelled");

    // An undo no redrive can ever apply (its order lost by a failover) goes only when asked.
    let purged = shop.env.msgctl(&["parked", "purge", "--endpoint", BILLING, "--yes", "--including-undos"]).await;
    assert!(purged.status.success(), "{purged:?}");
    assert!(parked_at(BILLING).await.is_empty());
}

/// An `order.placed` the broker refuses for good (its row names an internal exchange,
/// `Shop::refuse_placing`), parked in the outbox by the relay and its job quarantined: `msgctl outbox discard` abandons the
/// job and deletes the row, and the order ends cancelled with nothing taken: its `order.ended` goes
/// out unordered, since the `order.placed` it would wait behind at inventory will never come
/// (issue 56, row 7). An undo row, or one the relay still sends, is refused.
#[tokio::test]
async fn a_parked_order_placed_discarded_ends_its_order_cancelled_with_nothing_taken() {
    let relay_env = [("RELAY_MAX_ATTEMPTS", "2"), ("RELAY_RETRY_INITIAL", "50ms"), ("RELAY_RETRY_MAX", "200ms")];
    let relay_env = relay_env.iter().map(|(name, value)| (*name, (*value).to_owned())).collect();
    let mut shop = Shop::start(Options { relay_env, ..Options::default() }).await;
    shop.kill(Service::Relay).await;
    let job = shop.place(&[("SKU-3", 2)]).await;
    let placed = shop.refuse_placing(job).await;
    // Not parked yet: the relay would still send it.
    let refused = shop.env.msgctl(&["outbox", "discard", &placed.to_string()]).await;
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not parked"), "{refused:?}");

    shop.restart(Service::Relay).await;
    shop.wait_for_state(job, "quarantined").await;
    let discarded = shop.env.msgctl(&["outbox", "discard", &placed.to_string(), "--note", "no such exchange"]).await;
    assert!(discarded.status.success(), "{discarded:?}");
    let ended = shop.wait_for_state(job, "cancelled").await;
    assert!(ended["lastError"].as_str().is_some_and(|error| error.ends_with("no such exchange")), "{ended}");
    let left: i64 = sqlx::query_scalar("select count(*) from outbox where message_id = $1")
        .bind(placed)
        .fetch_one(&shop.orders)
        .await
        .expect("the outbox");
    assert_eq!(left, 0, "the row is gone");
    let taken: (i32, i32) = sqlx::query_as("select reserved, settled from stock where sku = 'SKU-3'")
        .fetch_one(&shop.inventory)
        .await
        .expect("stock");
    assert_eq!(taken, (0, 0), "nothing taken");
    shop.assert_books_balance().await;

    // The order's order.ended, parked by hand: an undo is never discarded.
    let ended_row: Uuid = sqlx::query_scalar(
        "update outbox set parked_at = now(), published_at = null
          where message_type = 'order.ended' and payload->>'jobId' = $1::text returning message_id",
    )
    .bind(job)
    .fetch_one(&shop.orders)
    .await
    .expect("the order's order.ended row");
    let refused = shop.env.msgctl(&["outbox", "discard", &ended_row.to_string()]).await;
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("undoes"), "{refused:?}");
}
