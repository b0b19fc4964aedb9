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

    let handled = "message_handling_duration_seconds_count{endpoint=\"inventory.order-placed\",outcome=\"succeeded\"}";
    assert_eq!(shop.metric(Service::Inventory, handled).await, 1, "one message handled by inventory");
    let billed =
        "message_handling_duration_seconds_count{endpoint=\"billing.inventory-reserved\",outcome=\"succeeded\"}";
    assert_eq!(shop.metric(Service::Billing, billed).await, 1);
    // order.placed, inventory.reserved and invoice.created: three rows, each confirmed once.
    assert_eq!(shop.metric(Service::Relay, "outbox_publish_lag_seconds_count").await, 3);
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
