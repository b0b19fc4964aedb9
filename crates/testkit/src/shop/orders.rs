//! What a test does with a running shop: place orders, read jobs and wait for their states, read
//! metrics, settle and read the books.

use std::time::Duration;

use chrono::Utc;
use lapin::types::AMQPValue;
use messaging::{envelope, publisher::Publisher};
use serde_json::Value;
use uuid::Uuid;

use super::{Instance, Run, Shop, WAIT};
use crate::{auth, eventually, http, ledger::Ledger};

/// The customer whose token places [`Shop::place`]'s orders.
pub const CUSTOMER: &str = "chaos";

impl Shop {
    /// `GET /jobs/{job_id}`.
    pub async fn job(&self, job_id: Uuid) -> Value {
        let url = format!("{}/jobs/{job_id}", self.front());
        let response = http::request("GET", &url, &[], None).await.expect("GET /jobs/{id}");
        assert_eq!(response.status, 200, "GET /jobs/{job_id}: {}", String::from_utf8_lossy(&response.body));
        response.json()
    }

    /// `GET /jobs/{job_id}/events`: the job's story.
    pub async fn job_events(&self, job_id: Uuid) -> Value {
        let url = format!("{}/jobs/{job_id}/events", self.front());
        let response = http::request("GET", &url, &[], None).await.expect("GET /jobs/{id}/events");
        assert_eq!(response.status, 200, "GET /jobs/{job_id}/events: {}", String::from_utf8_lossy(&response.body));
        response.json()
    }

    /// The kinds of the job's story, oldest first, once its last is `last` (its story only grows).
    pub async fn wait_for_story(&self, job_id: Uuid, last: &str) -> Value {
        eventually(&format!("job {job_id}'s story to reach {last}"), WAIT, || async {
            let story = self.job_events(job_id).await;
            let reached = story["events"].as_array().and_then(|events| events.last()).map(|e| e["kind"] == last);
            reached.unwrap_or(false).then_some(story)
        })
        .await
    }

    /// Panic if any service exited by itself.
    pub fn assert_all_running(&mut self) {
        let Run::Processes(services) = &mut self.run else { return };
        for (instance, running) in services {
            if let Err(status) = running.process.check_running() {
                panic!("{instance} exited by itself with {status}; logs in {}", self.log_dir.display());
            }
        }
    }

    /// `POST /orders` with a raw body and extra headers, as sent, with an operator's token unless
    /// `headers` name an `Authorization`; nothing is recorded.
    pub async fn post_order(&self, body: &str, headers: &[(&str, &str)]) -> http::Response {
        let url = format!("{}/orders", self.front());
        let operator = auth::bearer(&auth::operator());
        let mut headers = headers.to_vec();
        if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("authorization")) {
            headers.push(("Authorization", &operator));
        }
        http::request("POST", &url, &headers, Some(body)).await.expect("POST /orders")
    }

    /// Make the broker refuse `job_id`'s `order.placed` for good, returning its message id: its
    /// outbox row is pointed at an internal exchange, which takes no publish (`ACCESS_REFUSED`,
    /// closing the channel) on every version, whoever publishes. The relay must not have sent it
    /// yet: stop it before placing the order.
    pub async fn refuse_placing(&self, job_id: Uuid) -> Uuid {
        let connection = self.env.amqp().await;
        let channel = connection.create_channel().await.expect("channel");
        let internal = lapin::options::ExchangeDeclareOptions { durable: true, internal: true, ..Default::default() };
        let kind = lapin::ExchangeKind::Topic;
        channel
            .exchange_declare("elsewhere".into(), kind, internal, lapin::types::FieldTable::default())
            .await
            .expect("an internal exchange");
        let _ = connection.close(200, "bye".into()).await;
        sqlx::query_scalar(
            "update outbox set exchange = 'elsewhere'
              where message_type = 'order.placed' and payload->>'jobId' = $1::text and published_at is null
             returning message_id",
        )
        .bind(job_id)
        .fetch_one(&self.orders)
        .await
        .expect("the order's order.placed row, not yet published")
    }

    /// `POST /orders/{order_id}/cancel` as [`CUSTOMER`], whose orders [`Shop::place`] places.
    pub async fn cancel(&self, order_id: impl std::fmt::Display) -> http::Response {
        let url = format!("{}/orders/{order_id}/cancel", self.front());
        let customer = auth::bearer(&auth::customer(CUSTOMER));
        http::request("POST", &url, &[("Authorization", &customer)], None).await.expect("POST /orders/{id}/cancel")
    }

    /// `POST /orders` for `lines`, given up after 10 s (an API must answer, even if only 503). A
    /// 202's job id is recorded as accepted.
    pub async fn try_place(&mut self, lines: &[(&str, i32)]) -> std::io::Result<http::Response> {
        let lines: Vec<Value> = lines.iter().map(|(sku, q)| serde_json::json!({"sku": sku, "quantity": q})).collect();
        let body = serde_json::json!({"customerId": CUSTOMER, "lines": lines}).to_string();
        let url = format!("{}/orders", self.front());
        let customer = auth::bearer(&auth::customer(CUSTOMER));
        // The API bounds its own work by QUERY_DEADLINE; an answer later than that and a margin
        // is a hang.
        let limit = messaging::runtime::db::QUERY_DEADLINE + Duration::from_secs(5);
        let response =
            tokio::time::timeout(limit, http::request("POST", &url, &[("Authorization", &customer)], Some(&body)))
                .await
                .map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::TimedOut, format!("POST /orders took over {limit:?}"))
                })??;
        if response.status == 202 {
            let job_id = response.json()["jobId"].as_str().and_then(|id| id.parse().ok()).expect("202 names a jobId");
            self.accepted.push(job_id);
        }
        Ok(response)
    }

    /// Wait until the API accepts an order again (after an outage), placing it.
    pub async fn wait_until_accepting(&mut self) {
        let since = tokio::time::Instant::now();
        while self.try_place(&[("SKU-2", 1)]).await.map_or(0, |r| r.status) != 202 {
            assert!(since.elapsed() < WAIT, "the API did not accept orders again within {WAIT:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Place an order that must be accepted; returns its job id.
    pub async fn place(&mut self, lines: &[(&str, i32)]) -> Uuid {
        let response = self.try_place(lines).await.expect("POST /orders");
        assert_eq!(response.status, 202, "POST /orders: {}", String::from_utf8_lossy(&response.body));
        *self.accepted.last().expect("accepted job")
    }

    /// Place `count` orders of one to three lines from SKU-1..SKU-3 (ample stock); every tenth
    /// names an unknown SKU and will be rejected. Returns their job ids.
    pub async fn place_burst(&mut self, count: usize) -> Vec<Uuid> {
        let mut placed = Vec::with_capacity(count);
        for i in 0..count {
            let skus = ["SKU-1", "SKU-2", "SKU-3"];
            let mut lines: Vec<(&str, i32)> = (0..=i % 3).map(|l| (skus[(i + l) % 3], 1 + (i % 2) as i32)).collect();
            if i % 10 == 9 {
                lines.push(("NOPE-9", 1));
            }
            placed.push(self.place(&lines).await);
        }
        placed
    }

    /// The status of the job's order (`GET /orders/{orderId}`).
    pub async fn order_status(&self, job_id: Uuid) -> String {
        let order_id = self.job(job_id).await["orderId"].as_str().expect("the job names its order").to_owned();
        let url = format!("{}/orders/{order_id}", self.front());
        let response = http::request("GET", &url, &[], None).await.expect("GET /orders/{id}");
        assert_eq!(response.status, 200, "GET /orders/{order_id}: {}", String::from_utf8_lossy(&response.body));
        response.json()["status"].as_str().expect("the order's status").to_owned()
    }

    /// Publish a copy of the job's `order.placed`, as the relay sent it (its message id, body and
    /// job), with `headers` added, straight into `queue`: where the broker would put a copy that
    /// it dead-letters or that the runtime parks.
    pub async fn copy_order_placed(&self, job_id: Uuid, queue: &str, headers: &[(&str, AMQPValue)]) {
        self.copy_sent(job_id, "order.placed", queue, headers).await;
    }

    /// Publish a copy of the job's message of type `message_type` that the orders service sent
    /// (`order.placed`, `order.ended`), as [`Self::copy_order_placed`] does.
    pub async fn copy_sent(&self, job_id: Uuid, message_type: &str, queue: &str, headers: &[(&str, AMQPValue)]) {
        let (payload, message_id): (sqlx::types::Json<Value>, Uuid) = sqlx::query_as(
            "select payload, message_id from outbox where message_type = $1 and payload->>'jobId' = $2::text",
        )
        .bind(message_type)
        .bind(job_id)
        .fetch_one(&self.orders)
        .await
        .unwrap_or_else(|error| panic!("the job's {message_type} row: {error}"));
        let properties = envelope::Headers::raw(Some(job_id), 1).properties(message_id, message_type, Utc::now());
        let properties = envelope::with_headers(&properties, headers);
        let connection = self.env.amqp().await;
        let publisher = Publisher::open(&connection).await.expect("publisher");
        let body = serde_json::to_vec(&payload.0).expect("json");
        publisher.publish("", queue, &body, properties).await.expect("the copy confirmed");
        let _ = connection.close(200, "bye".into()).await;
    }

    /// Wait until inventory holds stock for the order (its reservation `held`).
    pub async fn wait_for_held_stock(&self, order_id: Uuid) {
        eventually(&format!("inventory to hold the stock of order {order_id}"), WAIT, || async {
            let held: i64 =
                sqlx::query_scalar("select count(*) from reservations where order_id = $1 and state = 'held'")
                    .bind(order_id)
                    .fetch_one(&self.inventory)
                    .await
                    .ok()?;
            (held == 1).then_some(())
        })
        .await;
    }

    /// Wait until the job reaches `state`, and return it.
    pub async fn wait_for_state(&self, job_id: Uuid, state: &str) -> Value {
        eventually(&format!("job {job_id} to be {state}"), WAIT, || async {
            let job = self.job(job_id).await;
            (job["state"] == state).then_some(job)
        })
        .await
    }

    /// Wait until a service has reached (or paused at) the failpoint `name` at least `times` times
    /// in all.
    pub async fn wait_for_failpoint(&self, at: impl Into<Instance>, name: &str, times: usize) {
        let process = &self.running(at).process;
        let what = format!("{} at failpoint {name} ({times} times)", process.name());
        eventually(&what, WAIT, || async { (process.failpoint_hits(name) >= times).then_some(()) }).await;
    }

    /// A counter's value (summed over its label sets) from a service instance's `/metrics`; 0 if absent.
    pub async fn metric(&self, at: impl Into<Instance>, series: &str) -> u64 {
        self.metric_value(at, series).await as u64
    }

    /// A series' value (summed over its label sets, e.g. a gauge or a histogram's `_count`) from
    /// a service's `/metrics`; 0 if absent. `series` may name some labels: `name{endpoint="e"`.
    pub async fn metric_value(&self, at: impl Into<Instance>, series: &str) -> f64 {
        let url = format!("{}/metrics", self.http(at));
        let Ok(response) = http::request("GET", &url, &[], None).await else { return 0.0 };
        let text = String::from_utf8_lossy(&response.body).into_owned();
        text.lines()
            .filter(|line| line.starts_with(series) && line[series.len()..].starts_with([' ', '{', ',', '}']))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Wait until every accepted order is in a terminal state and every outbox is drained (the
    /// last step's events may still be on their way when its job ends), then read the books;
    /// panics with the books after `timeout`.
    pub async fn settle(&self, timeout: Duration) -> Ledger {
        self.try_settle(timeout).await.unwrap_or_else(|ledger| {
            panic!("orders did not settle within {timeout:?}:\n{ledger}\nlogs in {}", self.log_dir.display())
        })
    }

    /// [`Shop::settle`], with the unsettled books as the error.
    pub async fn try_settle(&self, timeout: Duration) -> Result<Ledger, Ledger> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let ledger = self.ledger().await;
            if ledger.is_settled() {
                return Ok(ledger);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ledger);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// For a shop without demo faults: every accepted order settles in a final state,
    /// the books are clean, and no service died by itself.
    pub async fn assert_books_balance(&mut self) -> Ledger {
        let ledger = self.settle(WAIT).await;
        let logs = self.log_dir.display();
        assert!(ledger.is_clean(), "{ledger}\nlogs in {logs}");
        let ended = ledger.succeeded + ledger.rejected + ledger.declined + ledger.cancelled;
        assert_eq!(ended, ledger.accepted as i64, "{ledger}\nlogs in {logs}");
        self.assert_all_running();
        ledger
    }

    /// The books now.
    pub async fn ledger(&self) -> Ledger {
        Ledger::read(&self.orders, &self.inventory, &self.billing, &self.accepted, &self.initial_stock).await
    }
}
