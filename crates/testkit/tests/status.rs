//! The job a client sees never looks older than what is happening to it: the orders status
//! consumer, fed events in the order that misleads (a step's retry, then its success, then a late
//! copy of the retry), with nothing else running.

use std::time::Duration;

use chrono::Utc;
use clap::Parser;
use messaging::{
    contracts::{Contract, JobQuarantined, JobRedriven, JobRetryScheduled},
    envelope,
    runtime::shutdown,
};
use serde_json::Value;
use shop::{InventoryReserved, InvoiceCreated, OrderLine};
use testkit::{TestEnv, eventually, http};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

struct Api {
    env: TestEnv,
    base: String,
    orders: sqlx::PgPool,
}

impl Api {
    async fn job(&self, job_id: &str) -> Value {
        let response = http::request("GET", &format!("{}/jobs/{job_id}", self.base), &[], None).await.expect("GET");
        response.json()
    }

    /// Place an order of one SKU-1: its job id as text and as a UUID, and its order id.
    async fn place(&self) -> (String, Uuid, Uuid) {
        let body = r#"{"customerId":"c","lines":[{"sku":"SKU-1","quantity":1}]}"#;
        let customer = testkit::auth::bearer(&testkit::auth::customer("c"));
        let url = format!("{}/orders", self.base);
        let placed = http::request("POST", &url, &[("Authorization", &customer)], Some(body)).await.expect("POST");
        let job_id = placed.json()["jobId"].as_str().expect("jobId").to_owned();
        let order_id: Uuid = placed.json()["orderId"].as_str().expect("orderId").parse().expect("uuid");
        let job = job_id.parse().expect("uuid");
        (job_id, job, order_id)
    }

    /// The order's status column.
    async fn order_status(&self, order_id: Uuid) -> String {
        sqlx::query_scalar("select status from orders where id = $1")
            .bind(order_id)
            .fetch_one(&self.orders)
            .await
            .expect("the order")
    }

    /// Publish `event` as `C` and wait until the status consumer has applied it.
    async fn send<C: Contract + serde::Serialize>(&self, job_id: Uuid, event: &C) {
        let message_id = self.publish(job_id, event).await;
        testkit::wait_processed(&self.orders, message_id, WAIT).await;
    }

    /// Publish `event` as `C`, of job `job_id`; its message id.
    async fn publish<C: Contract + serde::Serialize>(&self, job_id: Uuid, event: &C) -> Uuid {
        self.env.publish(event, job_id, 1).await
    }
}

fn retry(job_id: Uuid, endpoint: &str, attempt: u32) -> JobRetryScheduled {
    JobRetryScheduled {
        job_id,
        endpoint: endpoint.into(),
        message_id: Uuid::now_v7(),
        message_type: "order.placed".into(),
        attempt,
        next_attempt: attempt + 1,
        next_attempt_at: Utc::now(),
        error: format!("{endpoint} failed on attempt {attempt}"),
    }
}

#[tokio::test]
async fn a_step_that_recovers_moves_its_job_on_and_a_late_retry_event_cannot_move_it_back() {
    let (api, trigger, task) = start_api().await;

    // No relay runs: the order stays as the API wrote it, and the events below are all it sees.
    let (job_id, job, order_id) = api.place().await;

    api.send(job, &retry(job, "inventory.order-placed", 1)).await;
    let seen = api.job(&job_id).await;
    assert_eq!((seen["state"].as_str(), seen["attempt"].as_i64()), (Some("retry_wait"), Some(2)), "{seen}");

    let lines = vec![OrderLine { sku: "SKU-1".into(), quantity: 1 }];
    api.send(job, &InventoryReserved { order_id, job_id: job, reservation_id: Uuid::now_v7(), lines, deadline: None })
        .await;
    let seen = api.job(&job_id).await;
    assert_eq!(seen["state"], "published", "inventory's step succeeded: no longer waiting on it: {seen}");
    assert_eq!(seen["attempt"], 2, "{seen}");
    assert_eq!(api.order_status(order_id).await, "reserved");

    // A copy of inventory's retry event that arrives late (reordered, or redelivered).
    api.send(job, &retry(job, "inventory.order-placed", 1)).await;
    assert_eq!(api.job(&job_id).await["state"], "published", "a late retry of a finished step changes nothing");

    // Billing's own retry does count.
    api.send(job, &retry(job, "billing.inventory-reserved", 1)).await;
    let seen = api.job(&job_id).await;
    assert_eq!(seen["state"], "retry_wait", "{seen}");
    assert_eq!(seen["lastError"], "billing.inventory-reserved failed on attempt 1", "{seen}");

    // The order's move is written in the job's statement, and made also when the job does not
    // move: here a job waiting on billing's retry, and an order set back by hand.
    sqlx::query("update orders set status = 'accepted' where id = $1")
        .bind(order_id)
        .execute(&api.orders)
        .await
        .expect("reset");
    let lines = vec![OrderLine { sku: "SKU-1".into(), quantity: 1 }];
    api.send(job, &InventoryReserved { order_id, job_id: job, reservation_id: Uuid::now_v7(), lines, deadline: None })
        .await;
    assert_eq!(api.job(&job_id).await["state"], "retry_wait", "waiting on billing, not on inventory");
    assert_eq!(api.order_status(order_id).await, "reserved");

    // The live page's data shows the job as the API does, and nothing quarantined: to an
    // operator's token only (401 without one, 403 for a customer's).
    let url = format!("{}/overview", api.base);
    assert_eq!(http::request("GET", &url, &[], None).await.expect("GET").status, 401);
    let customer = testkit::auth::bearer(&testkit::auth::customer("c"));
    assert_eq!(http::request("GET", &url, &[("Authorization", &customer)], None).await.expect("GET").status, 403);
    let operator = testkit::auth::bearer(&testkit::auth::operator());
    let overview = http::request("GET", &url, &[("Authorization", &operator)], None).await.expect("GET").json();
    assert_eq!(overview["jobs"][0]["jobId"], job_id, "{overview}");
    assert_eq!(overview["jobs"][0]["state"], "retry_wait", "{overview}");
    assert_eq!(overview["jobs"][0]["lines"], "1 × SKU-1", "{overview}");
    assert_eq!(overview["quarantined"], serde_json::json!([]), "{overview}");

    trigger.trigger();
    task.await.expect("api task").expect("api ran");
}

#[tokio::test]
async fn the_relays_mark_of_a_batch_publishes_each_of_its_queued_jobs_once() {
    let (api, trigger, task) = start_api().await;
    let mut jobs = Vec::new();
    for _ in 0..3 {
        jobs.push(api.place().await);
    }
    // One job already waits on a step's retry: being published does not move it back.
    let waiting = &jobs[2].0;
    api.send(jobs[2].1, &retry(jobs[2].1, "inventory.order-placed", 1)).await;

    // As the relay marks a batch: one UPDATE of all its rows.
    let mark = "update outbox set published_at = now() where message_type = 'order.placed' and published_at is null";
    let marked = sqlx::query(mark).execute(&api.orders).await.expect("mark").rows_affected();
    assert_eq!(marked, 3);
    let mut first = Vec::new();
    for (job_id, _, _) in &jobs {
        let seen = api.job(job_id).await;
        let expected = if job_id == waiting { "retry_wait" } else { "published" };
        assert_eq!(seen["state"], expected, "{seen}");
        assert!(seen["publishedAt"].is_string(), "{seen}");
        first.push(seen);
    }

    // An UPDATE that publishes nothing new (a later mark, a failed attempt's error) touches no job.
    sqlx::query("update outbox set published_at = now() + interval '1 hour', last_error = 'again'")
        .execute(&api.orders)
        .await
        .expect("mark again");
    for ((job_id, _, _), first) in jobs.iter().zip(first) {
        assert_eq!(api.job(job_id).await, first, "the job as the first publication left it");
    }

    trigger.trigger();
    task.await.expect("api task").expect("api ran");
}

/// The marking trigger's plan is made at its first firing on a connection and kept (migration
/// 0011). A mark of one row and then one of many on the same connection must publish them all in
/// time that grows with the rows, not with their square. The deadline below is a hang's, not a
/// speed's: the second mark takes about a second here, and took minutes with the trigger of 0007.
#[tokio::test]
async fn a_bulk_mark_after_a_one_row_mark_on_the_same_connection_publishes_every_job() {
    const ROWS: i64 = 40_000;
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    // The jobs and their order.placed rows, queued, as the API writes them (linked by message id).
    sqlx::query(
        "with made as (
             select gen_random_uuid() as order_id, gen_random_uuid() as job_id, gen_random_uuid() as message_id
               from generate_series(1, $1)),
         orders as (insert into orders (id, customer_id) select order_id, 'c' from made),
         jobs as (insert into jobs (id, order_id, order_placed_message_id)
                  select job_id, order_id, message_id from made)
         insert into outbox (message_id, message_type, exchange, routing_key, payload)
         select message_id, 'order.placed', 'orders', 'order.placed', '{}' from made",
    )
    .bind(ROWS)
    .execute(&pool)
    .await
    .expect("orders, jobs and outbox rows");

    let mut connection = pool.acquire().await.expect("connection");
    sqlx::query("set statement_timeout = '30s'").execute(&mut *connection).await.expect("timeout");
    let one = "update outbox set published_at = now() where id = (select min(id) from outbox)";
    sqlx::query(one).execute(&mut *connection).await.expect("mark one row");
    let rest = sqlx::query("update outbox set published_at = now() where published_at is null")
        .execute(&mut *connection)
        .await
        .expect("mark every other row within the deadline");
    assert_eq!(rest.rows_affected(), u64::try_from(ROWS - 1).expect("rows"));

    let (published, stamped): (i64, i64) = sqlx::query_as(
        "select count(*) filter (where j.state = 'published'),
                count(*) filter (where j.published_at = o.published_at)
           from jobs j join outbox o on o.message_id = j.order_placed_message_id",
    )
    .fetch_one(&pool)
    .await
    .expect("jobs");
    assert_eq!((published, stamped), (ROWS, ROWS), "every job published, at its row's mark");
}

#[tokio::test]
async fn with_the_live_page_off_neither_the_page_nor_its_data_is_served() {
    let (api, trigger, task) = start_api_with(&["--live-page", "off"]).await;
    for path in ["/", "/overview"] {
        let response = http::request("GET", &format!("{}{path}", api.base), &[], None).await.expect("GET");
        assert_eq!(response.status, 404, "{path}");
    }
    let (job_id, _, _) = api.place().await;
    assert_eq!(api.job(&job_id).await["jobId"], job_id, "the API itself still works");
    trigger.trigger();
    task.await.expect("api task").expect("api ran");
}

/// The API and its status consumer, in-process on a test's own database and vhost, without a relay.
async fn start_api()
-> (Api, shutdown::ShutdownTrigger, tokio::task::JoinHandle<Result<(), messaging::service::BoxError>>) {
    start_api_with(&[]).await
}

/// [`start_api`] with more flags.
async fn start_api_with(
    extra: &[&str],
) -> (Api, shutdown::ShutdownTrigger, tokio::task::JoinHandle<Result<(), messaging::service::BoxError>>) {
    let env = TestEnv::new().await;
    let orders = env.migrated_pool("orders", &orders_api::MIGRATOR).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (trigger, stop) = shutdown::channel();
    let (database, amqp) = (env.database_url("orders"), env.amqp_url());
    let flags = ["orders-api", "--database-url", &database, "--amqp-url", &amqp, "--auth-jwt-key", testkit::auth::KEY];
    let config = orders_api::Config::parse_from(flags.iter().chain(extra));
    let task = tokio::spawn(orders_api::run(config, listener, stop));
    testkit::wait_ready(&base, WAIT, "").await;
    (Api { env, base, orders }, trigger, task)
}

/// A job the orders database does not have: what a failover to an asynchronous standby leaves
/// when it loses the commit of an order whose `order.placed` had already been published.
#[tokio::test]
async fn events_for_a_job_the_database_does_not_have_are_parked_with_the_reason_and_report_nothing() {
    let (api, trigger, task) = start_api().await;
    let (job, order_id) = (Uuid::now_v7(), Uuid::now_v7());
    api.publish(
        job,
        &InventoryReserved { order_id, job_id: job, reservation_id: Uuid::now_v7(), lines: vec![], deadline: None },
    )
    .await;
    api.publish(job, &InvoiceCreated { order_id, job_id: job, invoice_id: Uuid::now_v7(), total_cents: 1 }).await;
    let quarantined = JobQuarantined {
        job_id: job,
        endpoint: "billing.inventory-reserved".into(),
        message_id: Some(Uuid::now_v7()),
        message_type: Some("inventory.reserved".into()),
        attempt: 1,
        error: "boom".into(),
        redrive_count: 0,
    };
    api.publish(job, &quarantined).await;

    // Each parked with the reason; the two step results each reported as a job.quarantined of the
    // unknown job, itself parked: five in all.
    let parking = orders_api::status::endpoint().parking_queue();
    eventually("the events and their reports to be parked", WAIT, || async {
        (api.env.queue_depth(&parking).await == Some(5)).then_some(())
    })
    .await;
    // Parking a job.quarantined reports nothing: the report would be parked in turn, and the
    // next, without end. Two events of a real job applied after them, nothing more is parked.
    let (job_id, real, _) = api.place().await;
    for attempt in [1, 2] {
        api.send(real, &retry(real, "inventory.order-placed", attempt)).await;
    }
    assert_eq!(api.job(&job_id).await["state"], "retry_wait");
    let parked = api.env.drain(&parking).await;
    assert_eq!(parked.len(), 5, "nothing but the three events and two reports parked");
    for delivery in &parked {
        let headers = delivery.properties.headers().clone().unwrap_or_default();
        let reason = envelope::header_text(&headers, envelope::HEADER_LAST_ERROR).expect("a reason");
        assert!(reason.contains(&format!("no job {job}")), "{reason}");
    }
    let applied: i64 = sqlx::query_scalar("select count(*) from jobs where id = $1")
        .bind(job)
        .fetch_one(&api.orders)
        .await
        .expect("count");
    assert_eq!(applied, 0, "no job was made up for it");

    trigger.trigger();
    task.await.expect("api task").expect("api ran");
}

#[tokio::test]
async fn a_redriven_job_leaves_quarantined_and_ends_as_its_new_attempts_go() {
    let (api, trigger, task) = start_api().await;
    let (job_id, job, order_id) = api.place().await;
    let quarantined = JobQuarantined {
        job_id: job,
        endpoint: "inventory.order-placed".into(),
        message_id: Some(Uuid::now_v7()),
        message_type: Some("order.placed".into()),
        attempt: 2,
        error: "boom".into(),
        redrive_count: 0,
    };
    api.send(job, &quarantined).await;
    assert_eq!(api.job(&job_id).await["state"], "quarantined");

    let redriven = JobRedriven {
        job_id: job,
        endpoint: "inventory.order-placed".into(),
        message_id: Uuid::now_v7(),
        redrive_count: 1,
    };
    api.send(job, &redriven).await;
    let seen = api.job(&job_id).await;
    assert_eq!(seen["state"], "published", "the one way out of quarantined: {seen}");
    assert_eq!(api.order_status(order_id).await, "accepted", "the order starts over");

    api.send(job, &InvoiceCreated { order_id, job_id: job, invoice_id: Uuid::now_v7(), total_cents: 1299 }).await;
    assert_eq!(api.job(&job_id).await["state"], "succeeded");
    // A copy of the redrive event (redelivered, or sent twice) cannot reopen an ended job.
    api.send(job, &redriven).await;
    assert_eq!(api.job(&job_id).await["state"], "succeeded");

    trigger.trigger();
    task.await.expect("api task").expect("api ran");
}

#[tokio::test]
async fn a_redrive_event_applied_after_the_quarantine_that_followed_it_changes_nothing() {
    let (api, trigger, task) = start_api().await;
    let (job_id, job, _) = api.place().await;
    let quarantined = |redrive_count| JobQuarantined {
        job_id: job,
        endpoint: "inventory.order-placed".into(),
        message_id: Some(Uuid::now_v7()),
        message_type: Some("order.placed".into()),
        attempt: 1,
        error: "boom".into(),
        redrive_count,
    };
    let redriven = |redrive_count| JobRedriven {
        job_id: job,
        endpoint: "inventory.order-placed".into(),
        message_id: Uuid::now_v7(),
        redrive_count,
    };
    api.send(job, &quarantined(0)).await;
    // Redrive 1 failed at once: its quarantine is applied before its redrive event.
    api.send(job, &quarantined(1)).await;
    api.send(job, &redriven(1)).await;
    assert_eq!(api.job(&job_id).await["state"], "quarantined", "the stale redrive loses");
    // Redrive 2 is newer than anything the job has seen.
    api.send(job, &redriven(2)).await;
    assert_eq!(api.job(&job_id).await["state"], "published");

    trigger.trigger();
    task.await.expect("api task").expect("api ran");
}

#[tokio::test]
async fn a_database_of_the_previous_release_migrates_forward_and_its_old_jobs_still_become_published() {
    let env = TestEnv::new().await;
    let pool = env.pool("orders").await;
    // The previous release: one folder of orders migrations up to 0004, which held its own copies
    // of messaging's 0001 and 0003, applied in version order by one migrator.
    let previous = std::env::temp_dir().join(format!("orders-migrations-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&previous).expect("folder");
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for folder in ["crates/messaging-core/migrations", "migrations/orders"] {
        for entry in std::fs::read_dir(workspace.join(folder)).expect("migrations") {
            let path = entry.expect("entry").path();
            let name = path.file_name().expect("name").to_string_lossy().into_owned();
            if name.as_str() < "0005" {
                std::fs::copy(&path, previous.join(&name)).expect("copy");
            }
        }
    }
    let migrator = sqlx::migrate::Migrator::new(previous.as_path()).await.expect("previous migrator");
    migrator.run(&pool).await.expect("migrate as the previous release");
    std::fs::remove_dir_all(&previous).expect("clean up");

    // A job and its order.placed row, as that release wrote them: linked only through the
    // row's JSON headers.
    let (order_id, job_id, message_id) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    sqlx::query("insert into orders (id, customer_id) values ($1, 'c')")
        .bind(order_id)
        .execute(&pool)
        .await
        .expect("order");
    sqlx::query("insert into jobs (id, order_id) values ($1, $2)")
        .bind(job_id)
        .bind(order_id)
        .execute(&pool)
        .await
        .expect("job");
    sqlx::query(
        "insert into outbox (message_id, message_type, exchange, routing_key, payload, headers)
         values ($1, 'order.placed', 'orders', 'order.placed', '{}', jsonb_build_object('correlation_id', $2::text, 'version', 1))",
    )
    .bind(message_id)
    .bind(job_id)
    .execute(&pool)
    .await
    .expect("outbox row");

    // This release migrates forward by itself (messaging's migrations now ship in its crate and
    // are recognised as applied); then the relay marks the row published.
    messaging::schema::migrate(&pool, &orders_api::MIGRATOR).await.expect("migrate forward");
    sqlx::query("update outbox set published_at = now() where message_id = $1")
        .bind(message_id)
        .execute(&pool)
        .await
        .expect("mark");
    let state: String =
        sqlx::query_scalar("select state from jobs where id = $1").bind(job_id).fetch_one(&pool).await.expect("job");
    assert_eq!(state, "published");
}

/// The job model checked in production (issue 60). The database allows exactly the moves the
/// code's table does (`moves::allowed`, every pair of states); the moves the status consumer makes
/// count nothing; a move outside the table, made by hand as an operator's mistake would be, is
/// counted in its own transaction, and the API exports it as `job_moves_forbidden_total{from,to}`
/// until the operator clears the table's row.
#[tokio::test]
async fn a_job_move_the_model_forbids_is_counted_and_exported_and_the_allowed_ones_are_not() {
    use orders_api::{jobs::JobState, moves};

    let (api, trigger, task) = start_api().await;
    for from in JobState::ALL {
        for to in JobState::ALL.into_iter().filter(|&to| to != from) {
            let allowed: bool = sqlx::query_scalar("select job_move_allowed($1, $2)")
                .bind(from.as_str())
                .bind(to.as_str())
                .fetch_one(&api.orders)
                .await
                .expect("job_move_allowed");
            assert_eq!(allowed, moves::allowed(from, to), "the database and the code disagree on {from:?} -> {to:?}");
        }
    }

    // queued -> retry_wait -> published -> succeeded, as the status consumer moves a job.
    let (job_id, job, order_id) = api.place().await;
    api.send(job, &retry(job, "inventory.order-placed", 1)).await;
    let lines = vec![OrderLine { sku: "SKU-1".into(), quantity: 1 }];
    api.send(job, &InventoryReserved { order_id, job_id: job, reservation_id: Uuid::now_v7(), lines, deadline: None })
        .await;
    api.send(job, &InvoiceCreated { order_id, job_id: job, invoice_id: Uuid::now_v7(), total_cents: 1299 }).await;
    assert_eq!(api.job(&job_id).await["state"], "succeeded");
    let forbidden = || async {
        sqlx::query_as::<_, (String, String, i64, Uuid)>(
            "select from_state, to_state, moves, last_job_id from job_moves_forbidden",
        )
        .fetch_all(&api.orders)
        .await
        .expect("job_moves_forbidden")
    };
    assert_eq!(forbidden().await, [], "the consumer's moves are all allowed");

    // An operator's mistake: a succeeded job set back by hand.
    sqlx::query("update jobs set state = 'published' where id = $1")
        .bind(job)
        .execute(&api.orders)
        .await
        .expect("by hand");
    assert_eq!(forbidden().await, [("succeeded".to_owned(), "published".to_owned(), 1, job)]);
    let url = format!("{}/metrics", api.base);
    let exported = |count: u32| {
        let (url, series) =
            (url.clone(), format!(r#"job_moves_forbidden_total{{from="succeeded",to="published"}} {count}"#));
        async move {
            let response = http::request("GET", &url, &[], None).await.expect("GET /metrics");
            String::from_utf8_lossy(&response.body).lines().any(|line| line == series).then_some(())
        }
    };
    eventually("the forbidden move in /metrics", WAIT, || exported(1)).await;
    // Understood, and cleared by the operator: the series goes back to 0, and the alert with it.
    sqlx::query("delete from job_moves_forbidden").execute(&api.orders).await.expect("cleared");
    eventually("the cleared move gone from /metrics", WAIT, || exported(0)).await;

    trigger.trigger();
    task.await.expect("api task").expect("api ran");
}
