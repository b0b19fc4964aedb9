//! A handler's batch lock ([`Handler::lock_batch`]): the runtime calls it in a batch's transaction,
//! before any of its messages is handled, with exactly the members the inbox had not seen (a
//! second copy of a message is not among them), and it commits, or not, with the batch.

use std::{sync::Arc, time::Duration};

use messaging::{
    consumer::{self, Batching},
    contracts::Contract,
    envelope::Incoming,
    handler::{Handler, HandlerError},
    runtime::{health::Health, shutdown},
    topology::{Endpoint, RetryPolicy},
};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use testkit::{TestEnv, eventually};
use uuid::Uuid;

#[derive(Debug, Serialize, Deserialize)]
struct Item {
    n: i64,
}

impl Contract for Item {
    const TYPE: &'static str = "test.item";
    const EXCHANGE: &'static str = "orders";
}

/// Records each batch lock it is asked for (the message ids, in one row per call), and each
/// message it handles, numbered from one sequence in the order they happened.
struct Recording;

impl Handler for Recording {
    async fn handle(&self, message: &Incoming, tx: &mut PgConnection) -> Result<(), HandlerError> {
        sqlx::query("insert into handled (message_id) values ($1)").bind(message.message_id).execute(&mut *tx).await?;
        Ok(())
    }

    async fn lock_batch(&self, messages: &[&Incoming], tx: &mut PgConnection) -> Result<(), HandlerError> {
        let ids: Vec<Uuid> = messages.iter().map(|message| message.message_id).collect();
        sqlx::query("insert into locked (message_ids) values ($1)").bind(&ids).execute(&mut *tx).await?;
        Ok(())
    }
}

#[tokio::test]
async fn a_batch_locks_what_its_unseen_messages_need_before_any_is_handled() {
    let env = TestEnv::new().await;
    let pool = env.messaging_pool("locking").await;
    sqlx::raw_sql(
        "create sequence steps;
         create table handled (n bigint primary key default nextval('steps'), message_id uuid not null);
         create table locked (n bigint primary key default nextval('steps'), message_ids uuid[] not null);",
    )
    .execute(&pool)
    .await
    .expect("tables");
    let endpoint = Endpoint::new("test.locking").consume::<Item>();
    let policy = RetryPolicy::new(vec![Duration::from_millis(50)], 3);
    env.declare_endpoint(&endpoint, &policy).await;

    // Queued before the consumer starts, so that its first batch takes them all: three messages,
    // the first of them twice (as a relay that crashed between a confirm and its mark sends it).
    let job = Uuid::now_v7();
    let twice = env.publish(&Item { n: 1 }, job, 2).await;
    let once = [env.publish(&Item { n: 2 }, job, 1).await, env.publish(&Item { n: 3 }, job, 1).await];

    let (trigger, stop) = shutdown::channel();
    let batch = Batching { max_size: 8, max_wait: Duration::from_millis(300) };
    let settings = env.consumer_settings(endpoint, policy, 16, batch);
    let consumer = tokio::spawn(consumer::run(settings, Arc::new(Recording), pool.clone(), Health::default(), stop));
    eventually("every message to be handled", Duration::from_secs(30), || async {
        let handled: i64 = sqlx::query_scalar("select count(*) from handled").fetch_one(&pool).await.ok()?;
        (handled == 3).then_some(())
    })
    .await;
    eventually("the queue to be drained", Duration::from_secs(10), || async {
        (env.queue_depth("test.locking").await == Some(0)).then_some(())
    })
    .await;
    trigger.trigger();
    consumer.await.expect("consumer");

    // Each unseen message was in exactly one lock, the second copy in none, and each was locked
    // for before it was handled.
    let locks: Vec<Vec<Uuid>> =
        sqlx::query_scalar("select message_ids from locked order by n").fetch_all(&pool).await.expect("locked");
    let mut locked: Vec<Uuid> = locks.concat();
    locked.sort();
    let mut expected = vec![twice, once[0], once[1]];
    expected.sort();
    assert_eq!(locked, expected, "every unseen message locked for once, the duplicate not at all");
    let handled_first: i64 = sqlx::query_scalar(
        "select count(*) from handled join locked on handled.message_id = any(locked.message_ids)
          where locked.n > handled.n",
    )
    .fetch_one(&pool)
    .await
    .expect("order");
    assert_eq!(handled_first, 0, "a message handled before its batch's lock");
    let handled: i64 = sqlx::query_scalar("select count(*) from handled").fetch_one(&pool).await.expect("handled");
    assert_eq!(handled, 3, "each message handled once");
}
