//! The upgrade's backlog (migration 0012, `orders_api::upgrade`) on an orders database as a
//! release before the saga left it: what each order placed then is owed, sent once. The whole
//! upgrade, from the real earlier releases, is `testkit`'s `tests/upgrade.rs`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use messaging::runtime::shutdown;
use serde_json::Value;
use sqlx::{
    PgPool,
    migrate::{Migration, Migrator},
};
use testkit::{TestEnv, eventually};
use uuid::Uuid;

/// Whether a migration had landed before the saga: messaging's up to 0104, the orders' up to 0009.
fn before_the_saga(migration: &Migration) -> bool {
    migration.version <= 9 || (101..=104).contains(&migration.version)
}

async fn order(pool: &PgPool, status: &str, state: &str, age: Duration) -> Uuid {
    let (order_id, job_id) = (Uuid::new_v4(), Uuid::new_v4());
    let created_at = Utc::now() - chrono::Duration::from_std(age).expect("an age");
    sqlx::query("insert into orders (id, customer_id, status, created_at, updated_at) values ($1, 'c', $2, $3, $3)")
        .bind(order_id)
        .bind(status)
        .bind(created_at)
        .execute(pool)
        .await
        .expect("an order");
    sqlx::query("insert into jobs (id, order_id, state, created_at) values ($1, $2, $3, $4)")
        .bind(job_id)
        .bind(order_id)
        .bind(state)
        .bind(created_at)
        .execute(pool)
        .await
        .expect("its job");
    order_id
}

#[tokio::test]
async fn orders_placed_before_the_saga_are_announced_or_given_a_deadline_once() {
    let env = TestEnv::new().await;
    let pool = env.pool("orders").await;
    let migrator = messaging::schema::combined(&orders_api::MIGRATOR).await.expect("the migrations");
    let before = migrator.iter().filter(|migration| before_the_saga(migration)).cloned().collect();
    Migrator::with_migrations(before).run(&pool).await.expect("migrate as the release before the saga");
    let hour = Duration::from_secs(3600);
    let invoiced = order(&pool, "invoiced", "succeeded", hour).await;
    let parked = order(&pool, "failed", "quarantined", hour).await;
    let rejected = order(&pool, "rejected", "rejected", hour).await;
    let in_flight = order(&pool, "accepted", "queued", Duration::from_secs(10)).await;
    migrator.run(&pool).await.expect("migrate to this release");
    // Placed since: announced by this release itself.
    let since = order(&pool, "invoiced", "succeeded", Duration::ZERO).await;

    let owed: Vec<(Uuid, String)> =
        sqlx::query_as("select order_id, owed from upgrade_backlog").fetch_all(&pool).await.expect("the backlog");
    let mut expected =
        vec![(invoiced, "ended".to_owned()), (parked, "deadline".into()), (in_flight, "deadline".into())];
    let mut owed = owed;
    owed.sort();
    expected.sort();
    assert_eq!(owed, expected, "rejected ({rejected}) took nothing, {since} was placed after the upgrade");

    let order_deadline = Duration::from_secs(60);
    let (trigger, shutdown) = shutdown::channel();
    // Two instances, as a deployment of two APIs starts them: each row is sent once.
    orders_api::upgrade::start(pool.clone(), order_deadline, shutdown.clone());
    orders_api::upgrade::start(pool.clone(), order_deadline, shutdown);
    eventually("the backlog to be sent", Duration::from_secs(30), || async {
        let left: i64 = sqlx::query_scalar("select count(*) from upgrade_backlog").fetch_one(&pool).await.ok()?;
        (left == 0).then_some(())
    })
    .await;
    trigger.trigger();

    let sent: Vec<(String, Value, Value, bool, DateTime<Utc>)> = sqlx::query_as(
        "select message_type, payload, headers, scheduled, available_at from outbox order by payload->>'orderId'",
    )
    .fetch_all(&pool)
    .await
    .expect("the outbox");
    assert_eq!(sent.len(), 3, "one message for each order owed one: {sent:?}");
    let now = Utc::now();
    for (message_type, payload, headers, scheduled, available_at) in sent {
        let order_id: Uuid = payload["orderId"].as_str().and_then(|id| id.parse().ok()).expect("an order id");
        assert!(headers.get("ordering_key").is_none(), "sent unordered: {headers}");
        if order_id == invoiced {
            assert_eq!((message_type.as_str(), &payload["end"]), ("order.ended", &Value::from("invoiced")));
        } else {
            assert_eq!(message_type, "order.deadline", "{order_id}");
            assert!(scheduled, "a deadline waits for its time");
            // A new order's time from the upgrade, however old the order (parked an hour ago, or
            // in flight across the upgrade).
            let due_in = (available_at - now).num_seconds();
            assert!((50..=60).contains(&due_in), "{order_id}: due in about 60 s, not {due_in}");
        }
    }
}
