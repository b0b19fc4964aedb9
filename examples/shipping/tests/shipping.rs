//! The example service as shipped: its binary, started as a process on a test's own database and
//! vhost, ships each invoiced order once however often its message arrives, ships no cancelled
//! one, and stops cleanly.

use std::time::Duration;

use shop::{End, OrderEnded};
use testkit::{TestEnv, eventually, process};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(30);

testkit::binary_tests!(worker "shipping-worker", []);

#[tokio::test]
async fn an_invoiced_order_is_shipped_once_and_announced_once_though_delivered_twice_and_a_cancelled_one_never() {
    let env = TestEnv::new().await;
    let port = process::free_port();
    let log_dir = std::env::temp_dir().join(format!("shipping-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&log_dir).expect("log directory");
    let vars = [
        ("DATABASE_URL", env.database_url("shipping")),
        ("AMQP_URL", env.amqp_url()),
        ("HTTP_ADDR", format!("127.0.0.1:{port}")),
    ];
    let mut worker = process::Process::spawn(
        "shipping-worker",
        env!("CARGO_BIN_EXE_shipping-worker").into(),
        vars.map(|(name, value)| (name.to_owned(), value)).to_vec(),
        &log_dir,
    );
    // Ready means its database is migrated and its queues are declared and consumed.
    testkit::wait_ready(&format!("http://127.0.0.1:{port}"), WAIT, &format!("(log: {})", worker.log_path().display()))
        .await;

    let cancelled = OrderEnded { order_id: Uuid::now_v7(), job_id: Uuid::now_v7(), end: End::Cancelled, reason: None };
    let cancelled_id = env.publish(&cancelled, cancelled.job_id, 1).await;
    let invoice = OrderEnded { order_id: Uuid::now_v7(), job_id: Uuid::now_v7(), end: End::Invoiced, reason: None };
    let message_id = env.publish(&invoice, invoice.job_id, 2).await;

    let pool = env.pool("shipping").await;
    testkit::wait_processed(&pool, cancelled_id, WAIT).await;
    testkit::wait_processed(&pool, message_id, WAIT).await;
    // The second copy is skipped by the inbox: wait for the worker's count of it.
    eventually("the duplicate to be skipped", WAIT, || async {
        let metrics =
            testkit::http::request("GET", &format!("http://127.0.0.1:{port}/metrics"), &[], None).await.ok()?;
        let text = String::from_utf8_lossy(&metrics.body).into_owned();
        text.contains("inbox_duplicates_skipped_total{endpoint=\"shipping.order-ended\"} 1").then_some(())
    })
    .await;
    let shipments: Vec<Uuid> =
        sqlx::query_scalar("select order_id from shipments").fetch_all(&pool).await.expect("shipments");
    assert_eq!(shipments, [invoice.order_id]);
    let announced: Vec<(String, String)> =
        sqlx::query_as("select message_type, exchange from outbox").fetch_all(&pool).await.expect("outbox");
    assert_eq!(announced, [("shipment.scheduled".to_owned(), "shipping".to_owned())]);

    // Its own route, beside the health routes it was ready on.
    let base = format!("http://127.0.0.1:{port}");
    let shipped = testkit::http::request("GET", &format!("{base}/shipments/{}", invoice.order_id), &[], None)
        .await
        .expect("GET the shipment");
    assert_eq!(shipped.status, 200);
    let shipment: shipping_worker::Shipment = serde_json::from_slice(&shipped.body).expect("a shipment");
    assert_eq!((shipment.order_id, shipment.job_id), (invoice.order_id, Some(invoice.job_id)));
    let none = testkit::http::request("GET", &format!("{base}/shipments/{}", cancelled.order_id), &[], None)
        .await
        .expect("GET no shipment");
    assert_eq!(none.status, 404);
    assert_eq!(none.header("content-type"), Some("application/problem+json"));
    let problem: serde_json::Value = serde_json::from_slice(&none.body).expect("a problem document");
    assert_eq!(problem["status"], 404);

    let status = worker.terminate(WAIT).await.expect("stops on SIGTERM");
    assert!(status.success(), "{status:?}\n{}", worker.log_text());
    std::fs::remove_dir_all(&log_dir).expect("clean up");
}
