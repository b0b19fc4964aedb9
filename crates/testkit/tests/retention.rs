//! Retention: a worker deletes inbox rows, crash counts and ordering keys (with their given-up
//! places) older than `INBOX_RETENTION`, and the relay published outbox rows and ordering keys
//! older than `OUTBOX_RETENTION`; younger rows, and unpublished ones, stay.

use clap::Parser;
use messaging::{runtime::shutdown, service::BoxError};
use sqlx::PgPool;
use testkit::{
    TestEnv, eventually,
    shop::{Options, WAIT},
};
use tokio::net::TcpListener;
use uuid::Uuid;

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

/// Rows received, started or published `days` ago.
async fn age(pool: &PgPool, days: i32) {
    let message_id = Uuid::now_v7();
    sqlx::query(
        "insert into inbox (message_id, message_type, endpoint, received_at)
         values ($1, 'order.placed', 'inventory.order-placed', now() - make_interval(days => $2))",
    )
    .bind(message_id)
    .bind(days)
    .execute(pool)
    .await
    .expect("inbox row");
    sqlx::query(
        "insert into delivery_starts (endpoint, message_id, first_started_at, last_started_at)
         values ('inventory.order-placed', $1, now() - make_interval(days => $2), now() - make_interval(days => $2))",
    )
    .bind(message_id)
    .bind(days)
    .execute(pool)
    .await
    .expect("crash count");
    sqlx::query(
        "insert into outbox (message_id, message_type, exchange, routing_key, payload, created_at, published_at)
         values ($1, 'inventory.reserved', 'inventory', 'inventory.reserved', '{}',
                 now() - make_interval(days => $2), now() - make_interval(days => $2))",
    )
    .bind(Uuid::now_v7())
    .bind(days)
    .execute(pool)
    .await
    .expect("published outbox row");
    // An ordering key at both ends, last moved then.
    let key = format!("order:{message_id}");
    for statement in [
        "insert into outbox_key_sequences (key, last, numbered_at) values ($1, 2, now() - make_interval(days => $2))",
        "insert into inbox_key_positions (endpoint, key, next, moved_at)
         values ('inventory.order-placed', $1, 2, now() - make_interval(days => $2))",
        "insert into inbox_key_given_up (endpoint, key, follows, seq, given_up_at)
         values ('inventory.order-placed', $1, 3, 4, now() - make_interval(days => $2))",
    ] {
        sqlx::query(statement).bind(&key).bind(days).execute(pool).await.expect(statement);
    }
}

#[tokio::test]
async fn rows_past_retention_are_deleted_and_younger_ones_stay() {
    let env = TestEnv::new().await;
    let pool = env.migrated_pool("inventory", &inventory_worker::MIGRATOR).await;
    age(&pool, 30).await;
    age(&pool, 3).await;

    let (trigger, stop) = shutdown::channel();
    let worker = inventory_worker::worker();
    let mut args = vec!["inventory-worker".to_owned()];
    args.extend(Options::default().consumer_flags(env.database_url("inventory"), env.amqp_url()));
    args.extend(["--inbox-retention", "14d"].map(str::to_owned));
    let settings = worker.try_parse_from(args).expect("flags");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let inventory = tokio::spawn(worker.run(settings, listener, stop.clone()));
    let mut args = vec!["relay".to_owned()];
    args.extend(Options::relay_flags(&env.database_url("inventory"), &env.amqp_url()));
    args.extend(["--retention", "7d"].map(str::to_owned));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let relay = tokio::spawn(relay::run(relay::Config::parse_from(args), listener, stop));

    eventually("rows past retention to be deleted", WAIT, || async {
        let left = [
            count(&pool, "select count(*) from inbox").await,
            count(&pool, "select count(*) from delivery_starts").await,
            count(&pool, "select count(*) from outbox").await,
            count(&pool, "select count(*) from outbox_key_sequences").await,
            count(&pool, "select count(*) from inbox_key_positions").await,
            count(&pool, "select count(*) from inbox_key_given_up").await,
        ];
        (left == [1; 6]).then_some(())
    })
    .await;
    for youngest in [
        "select count(*) from inbox where received_at > now() - interval '4 days'",
        "select count(*) from outbox_key_sequences where numbered_at > now() - interval '4 days'",
        "select count(*) from inbox_key_positions where moved_at > now() - interval '4 days'",
        "select count(*) from inbox_key_given_up where given_up_at > now() - interval '4 days'",
    ] {
        assert_eq!(count(&pool, youngest).await, 1, "the 3-day-old row stays: {youngest}");
    }

    trigger.trigger();
    let stopped: Result<(), BoxError> = async {
        tokio::time::timeout(WAIT, inventory).await??.map_err(BoxError::from)?;
        tokio::time::timeout(WAIT, relay).await??
    }
    .await;
    stopped.expect("both stop cleanly");
}
