//! A broker named by several nodes (`AMQP_URL` with one URL per node, comma-separated): when the
//! node a service is connected to goes away, the service moves to the next node by itself,
//! nothing is lost or applied twice, and `/readyz` names the node each broker session is on.
//!
//! The two "nodes" are two fault proxies in front of the test's one broker, so this tests the
//! clients' failover alone, on every broker version of the matrix; what a real cluster adds
//! (queues led by the node that died, Raft elections) is the cluster rig's to test.

use std::collections::BTreeMap;

use testkit::{
    eventually, http,
    shop::{Options, Service, Shop, WAIT},
};

/// The service's `/readyz`: whether it is ready, and the node each broker session is on.
async fn readiness(shop: &Shop, service: Service) -> Option<(bool, BTreeMap<String, String>)> {
    let response = http::request("GET", &format!("{}/readyz", shop.http(service)), &[], None).await.ok()?;
    let body: serde_json::Value = serde_json::from_slice(&response.body).ok()?;
    let nodes = serde_json::from_value(body["brokerNodes"].clone()).ok()?;
    Some((response.status == 200 && !testkit::reports_broker_failing(&body), nodes))
}

/// Wait until `service` is ready with every broker session on `node` (`host:port`).
async fn wait_on_node(shop: &Shop, service: Service, node: &str) -> BTreeMap<String, String> {
    eventually(&format!("{service:?} ready with every broker session on {node}"), WAIT, || async {
        let (ready, nodes) = readiness(shop, service).await?;
        (ready && !nodes.is_empty() && nodes.values().all(|on| on == node)).then_some(nodes)
    })
    .await
}

/// `service`'s proxy to node `i` (0 or 1), as `/readyz` names it.
fn node(shop: &Shop, service: Service, i: usize) -> String {
    shop.broker_proxies(service)[i].addr().to_string()
}

/// Wait until every service is ready on node `i`; each one's broker sessions, by service.
async fn all_on_node(shop: &Shop, i: usize) -> Vec<(Service, BTreeMap<String, String>)> {
    let mut sessions = Vec::new();
    for service in Service::ALL {
        sessions.push((service, wait_on_node(shop, service, &node(shop, service, i)).await));
    }
    sessions
}

/// A shop whose services name two nodes, with a first burst placed, every service on the first.
async fn shop_on_two_nodes() -> (Shop, Vec<(Service, BTreeMap<String, String>)>) {
    let mut shop = Shop::start(Options { broker_nodes: 2, ..Options::default() }).await;
    shop.place_burst(20).await;
    let sessions = all_on_node(&shop, 0).await;
    (shop, sessions)
}

#[tokio::test]
async fn every_service_moves_to_the_next_node_when_its_node_goes_away() {
    let (mut shop, sessions) = shop_on_two_nodes().await;
    for (service, sessions) in sessions {
        // The API's status consumer, each worker's consumer, the relay's three loops.
        let expected = if service == Service::Relay { 3 } else { 1 };
        assert_eq!(sessions.len(), expected, "{service:?}'s broker sessions: {sessions:?}");
    }

    // The first node goes away for every service at once, mid-traffic, and stays away.
    for service in Service::ALL {
        shop.broker_proxies(service)[0].cut();
    }
    shop.place_burst(20).await;
    all_on_node(&shop, 1).await;
    for service in Service::ALL {
        assert_eq!(shop.broker_proxies(service)[0].open_connections(), 0, "{service:?} left the first node");
    }
    shop.place_burst(10).await;
    shop.assert_books_balance().await;

    // And back: the second node goes away, the first is there again.
    for service in Service::ALL {
        shop.broker_proxies(service)[0].restore();
        shop.broker_proxies(service)[1].cut();
    }
    shop.place_burst(10).await;
    all_on_node(&shop, 0).await;
    shop.assert_books_balance().await;
}

/// A partition between the services and the node they are on: their connections stay open and
/// nothing passes (the proxies stall). The heartbeat (10 s unless `AMQP_URL` says otherwise) tells
/// them within about 20 s, and they move to the next node with nothing lost.
#[tokio::test]
async fn a_node_cut_off_by_a_partition_is_left_within_the_heartbeat() {
    let (mut shop, _) = shop_on_two_nodes().await;
    for service in Service::ALL {
        shop.broker_proxies(service)[0].stall();
    }
    let partitioned = std::time::Instant::now();
    shop.place_burst(20).await;
    all_on_node(&shop, 1).await;
    println!("failover: every service left the silent node {:?} after the partition", partitioned.elapsed());
    shop.assert_books_balance().await;
}
