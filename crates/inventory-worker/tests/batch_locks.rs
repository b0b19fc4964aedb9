//! Two batches of orders that cross on the same SKUs, handled together as two instances of the
//! worker handle them: each batch locks its stock rows first, in SKU order, so the second waits for
//! the first instead of each holding a row the other's next order needs (a deadlock, which
//! Postgres breaks only after `deadlock_timeout`, a second, and which costs one batch a retry).

use std::time::Duration;

use inventory_worker::{MIGRATOR, ReserveStock};
use messaging::handler::{Context, Handle, LockBatch};
use shop::{OrderLine, OrderPlaced};
use sqlx::{PgConnection, PgPool};
use testkit::{TestEnv, eventually};
use uuid::Uuid;

fn order(sku: &str) -> OrderPlaced {
    let line = OrderLine { sku: sku.to_owned(), quantity: 1 };
    OrderPlaced {
        order_id: Uuid::now_v7(),
        job_id: Uuid::now_v7(),
        customer_id: "crossing".to_owned(),
        lines: vec![line],
        deadline: None,
    }
}

/// Lock a batch's rows, then reserve each of its orders, as the consumer runtime does in a batch's
/// transaction.
async fn handle_all(handler: &ReserveStock, orders: &[OrderPlaced], tx: &mut PgConnection) {
    for order in orders {
        let context = Context { message_id: Uuid::now_v7(), attempt: 1, job_id: Some(order.job_id) };
        handler.handle(order.clone(), &context, tx).await.expect("reserve");
    }
}

async fn available(pool: &PgPool, sku: &str) -> i32 {
    sqlx::query_scalar("select available from stock where sku = $1").bind(sku).fetch_one(pool).await.expect("stock")
}

/// Sessions on this test's database waiting for a lock.
async fn waiting(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "select count(*) from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .expect("pg_stat_activity")
}

#[tokio::test]
async fn two_batches_that_cross_on_the_same_skus_wait_for_each_other_instead_of_deadlocking() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("inventory", &MIGRATOR).await;
    shop_demo::stock_catalogue(&mut pool.acquire().await.expect("connection")).await.expect("the demo's stock");
    let handler = ReserveStock::default();
    let before = (available(&pool, "SKU-1").await, available(&pool, "SKU-2").await);
    // Handled one order at a time, these two would deadlock: the first takes SKU-2, the second
    // SKU-1, and each then waits for the other's.
    let first = [order("SKU-2"), order("SKU-1")];
    let second = vec![order("SKU-1"), order("SKU-2")];

    let mut first_tx = pool.begin().await.expect("begin");
    handler.lock_batch(&first, &mut first_tx).await.expect("lock the first batch");
    let second_batch = tokio::spawn({
        let (pool, handler) = (pool.clone(), handler.clone());
        async move {
            let mut tx = pool.begin().await.expect("begin");
            handler.lock_batch(&second, &mut tx).await.expect("lock the second batch");
            handle_all(&handler, &second, &mut tx).await;
            tx.commit().await.expect("commit the second batch");
        }
    });
    // The second batch waits at its lock, holding no stock row: the first batch's orders then
    // find every row they need already theirs.
    eventually("the second batch to wait for the first's rows", Duration::from_secs(10), || async {
        (waiting(&pool).await > 0).then_some(())
    })
    .await;
    tokio::time::timeout(Duration::from_secs(10), handle_all(&handler, &first, &mut first_tx))
        .await
        .expect("the first batch's orders wait for no row");
    first_tx.commit().await.expect("commit the first batch");
    tokio::time::timeout(Duration::from_secs(10), second_batch)
        .await
        .expect("the second batch goes on once the first commits")
        .expect("the second batch's task");

    let reservations: i64 =
        sqlx::query_scalar("select count(*) from reservations").fetch_one(&pool).await.expect("count");
    assert_eq!(reservations, 4, "every order reserved once");
    assert_eq!((available(&pool, "SKU-1").await, available(&pool, "SKU-2").await), (before.0 - 2, before.1 - 2));
}
