//! `/metrics` after traffic: the latency histograms of every hop, and the age of the oldest
//! unpublished outbox row growing while the relay is stopped.

use testkit::{
    eventually,
    shop::{Options, Service, Shop, WAIT},
};

#[tokio::test]
async fn histograms_fill_with_traffic_and_the_outbox_age_grows_while_the_relay_is_down() {
    let mut shop = Shop::start(Options::default()).await;
    let job = shop.place(&[("SKU-1", 1)]).await;
    shop.wait_for_state(job, "succeeded").await;
    // Its reservation settled too (order.ended: invoiced).
    shop.settle(WAIT).await;

    let handled = "message_handling_duration_seconds_count{endpoint=\"inventory.order-placed\",outcome=\"succeeded\"}";
    assert_eq!(shop.metric(Service::Inventory, handled).await, 2, "order.placed and order.ended, by inventory");
    let billed =
        "message_handling_duration_seconds_count{endpoint=\"billing.inventory-reserved\",outcome=\"succeeded\"}";
    // An invoiced order's end is not routed to billing, which has nothing to undo.
    assert_eq!(shop.metric(Service::Billing, billed).await, 1, "inventory.reserved alone, by billing");
    // order.placed, inventory.reserved, invoice.created and order.ended: four rows, each confirmed
    // once (the order's deadline is not due).
    assert_eq!(shop.metric(Service::Relay, "outbox_publish_lag_seconds_count").await, 4);
    let lag = shop.metric_value(Service::Relay, "outbox_publish_lag_seconds_sum").await;
    assert!(lag > 0.0 && lag < 30.0, "commit -> confirm lag {lag} s");
    let ended = "job_duration_seconds_count{state=\"succeeded\"}";
    assert_eq!(shop.metric(Service::Api, ended).await, 1, "one job ended, measured from its POST");

    shop.kill(Service::Relay).await;
    shop.place(&[("SKU-1", 1)]).await;
    let age = "outbox_oldest_unpublished_age_seconds{database=\"orders\"}";
    let first = eventually("the unpublished row to age", WAIT, || async {
        let seconds = shop.metric_value(Service::Api, age).await;
        (seconds > 0.0).then_some(seconds)
    })
    .await;
    eventually("the age to keep growing while the relay is down", WAIT, || async {
        (shop.metric_value(Service::Api, age).await >= first + 1.0).then_some(())
    })
    .await;
    shop.restart(Service::Relay).await;
    eventually("the age to fall back to 0 once the relay publishes", WAIT, || async {
        (shop.metric_value(Service::Api, age).await == 0.0).then_some(())
    })
    .await;
    shop.assert_books_balance().await;
}

/// The outbox gauges stay cheap however many published rows retention keeps: at 300,000 published
/// rows (50 million in production is a week of a busy shop), each gauge query's plan reads the
/// partial index of unpublished rows, never the table. (`count(*)` over the table did, and took
/// over the scrape's 2 s at 50 million rows: the age gauge, the paging alert's, then vanished.)
#[tokio::test]
async fn the_outbox_gauges_read_the_unpublished_rows_index_not_the_table() {
    let env = testkit::TestEnv::new().await;
    let pool = env.messaging_pool("gauges").await;
    sqlx::query(
        "insert into outbox (message_id, message_type, exchange, routing_key, payload, published_at)
         select gen_random_uuid(), 'probe', 'probe', 'probe', '{}', now() from generate_series(1, 300000)",
    )
    .execute(&pool)
    .await
    .expect("fill the outbox with published rows");
    sqlx::query("insert into outbox (message_id, message_type, exchange, routing_key, payload) values (gen_random_uuid(), 'probe', 'probe', 'probe', '{}')")
        .execute(&pool)
        .await
        .expect("one unpublished row");
    sqlx::query(
        "insert into outbox (message_id, message_type, exchange, routing_key, payload, available_at, scheduled)
         values (gen_random_uuid(), 'probe', 'probe', 'probe', '{}', now() + interval '1 hour', true)",
    )
    .execute(&pool)
    .await
    .expect("one row scheduled for later");
    sqlx::query("analyze outbox").execute(&pool).await.expect("analyze");

    for (name, sql) in [("count", messaging::outbox::COUNT_UNPUBLISHED), ("age", messaging::outbox::OLDEST_UNPUBLISHED)]
    {
        let explain = format!("explain (format json) {}", sql.replace("$1", &messaging::outbox::COUNT_CAP.to_string()));
        let plan: serde_json::Value =
            sqlx::query_scalar(sqlx::AssertSqlSafe(explain)).fetch_one(&pool).await.expect("explain");
        let plan = plan.to_string();
        assert!(!plan.contains("Seq Scan"), "the {name} gauge reads the whole outbox: {plan}");
        assert!(plan.contains("outbox_unpublished"), "the {name} gauge does not use the index: {plan}");
        assert!(plan.contains("outbox_scheduled"), "the {name} gauge does not use the scheduled rows' index: {plan}");
    }
    let gauges = messaging::outbox::gauges(&pool).await.expect("gauges");
    assert_eq!((gauges.unpublished, gauges.parked, gauges.scheduled), (1, 0, 1));
    assert!(gauges.oldest_unpublished_age_seconds < 60.0, "the scheduled row counts as late: {gauges:?}");
}
