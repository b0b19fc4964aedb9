//! The broker itself restarts (`rabbitmqctl stop_app`, then `start_app`) during a burst: every
//! service reconnects by itself and the books balance.
//!
//! It stops the shared RabbitMQ, so it would disturb every other test running at the time: it is
//! ignored in the normal run, and `.ci/run` runs it on its own afterwards:
//! `cargo test -p testkit --test broker_restart -- --ignored`. Needs `rabbitmqctl` for the broker
//! that `AMQP_URL` names: the local node, or the command in `RABBITMQCTL`.

use std::time::Duration;

use testkit::shop::{Options, Service, Shop};

async fn rabbitmqctl(command: &str) {
    let status = testkit::rabbitmqctl_command(&["-q", command]).status().await;
    assert!(matches!(status, Ok(s) if s.success()), "rabbitmqctl {command}: {status:?}");
}

#[tokio::test]
#[ignore = "restarts the shared broker; .ci/run runs it alone"]
async fn every_service_recovers_from_a_broker_restart_mid_burst() {
    let mut shop = Shop::start(Options::default()).await;
    shop.place_burst(30).await;

    rabbitmqctl("stop_app").await;
    // The API only writes to its database: it keeps accepting while the broker is away.
    shop.place_burst(10).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    rabbitmqctl("start_app").await;
    rabbitmqctl("await_startup").await;

    shop.place_burst(10).await;
    for service in Service::ALL {
        shop.wait_ready(service).await;
    }
    shop.assert_books_balance().await;
}
