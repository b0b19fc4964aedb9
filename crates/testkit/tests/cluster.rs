//! The shop on a three-node RabbitMQ cluster (`.ci/rabbitmq-cluster`), every service naming all
//! three nodes in its `AMQP_URL` (through a proxy each). The node that leads the inventory
//! worker's quorum queue dies (`kill -9`) mid-burst and later comes back; then the node the
//! inventory worker is connected to does; then the billing worker's node is stopped as an
//! operator would stop it: each time nothing is lost or applied twice, and every service is ready
//! again.
//!
//! A consumer connected through the node that dies may hold deliveries when it dies. The quorum
//! queue cannot tell a dead node from one behind a partition, so it returns them only after its
//! `consumer_disconnected_timeout` (RabbitMQ 4.x; a minute here): until then those orders wait,
//! and the test gives them two and a half minutes and prints how long it took.
//!
//! Ignored in the normal run, which has one node: `.ci/run` starts the cluster and runs it with
//! `eval "$(.ci/rabbitmq-cluster env)"; cargo test -p testkit --test cluster -- --ignored`.

use std::time::{Duration, Instant};

use testkit::{
    http,
    shop::{Options, Service, Shop},
};

/// How long the orders may take to settle after a node dies: the queue's
/// `consumer_disconnected_timeout` (60 s by default) and then some.
const RIDE_OUT: Duration = Duration::from_secs(150);

/// `.ci/rabbitmq-cluster ARGS...`, as `TEST_CLUSTER_CTL` names it; its output.
async fn cluster(args: &[&str]) -> String {
    let ctl = std::env::var("TEST_CLUSTER_CTL")
        .expect("TEST_CLUSTER_CTL names the cluster's script: eval \"$(.ci/rabbitmq-cluster env)\"");
    let output = tokio::process::Command::new(&ctl).args(args).output().await.expect("run the cluster's script");
    assert!(output.status.success(), "{ctl} {}: {output:?}", args.join(" "));
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// The node (`rabbitcN@localhost`) that leads quorum queue `queue` of the test's vhost.
async fn leader(shop: &Shop, queue: &str) -> String {
    let path = format!("/api/queues/{}/{queue}", shop.env.vhost());
    let response = http::request("GET", &http::join(shop.env.management_url(), &path), &[], None)
        .await
        .expect("the management API");
    assert_eq!(response.status, 200, "{}", String::from_utf8_lossy(&response.body));
    let queue: serde_json::Value = serde_json::from_slice(&response.body).expect("a queue");
    queue["leader"].as_str().unwrap_or_else(|| panic!("a quorum queue has a leader: {queue}")).to_owned()
}

#[tokio::test]
#[ignore = "needs the three-node cluster of .ci/rabbitmq-cluster; .ci/run runs it"]
async fn a_dying_node_loses_nothing_whether_it_leads_the_queue_or_holds_the_connections() {
    let mut shop = Shop::start(Options::default()).await;
    assert_eq!(shop.env.amqp_nodes().len(), 3, "AMQP_URL names the cluster's three nodes");
    shop.place_burst(30).await;
    let queue = "inventory.order-placed";
    let leading = leader(&shop, queue).await;
    let node = (1..=3).find(|n| leading == format!("rabbitc{n}@localhost")).expect("a node of the cluster");
    down_and_back(&mut shop, "kill", node, &format!("leading {queue}")).await;
    println!("cluster: {queue} now led by {}", leader(&shop, queue).await);

    let on = connected_node(&shop, Service::Inventory).await;
    down_and_back(&mut shop, "kill", on, "holding the inventory worker's connection").await;

    // An operator's stop (a rolling upgrade's): the node closes its connections and hands its
    // queues over, so nothing waits for the disconnected-consumer timeout.
    let on = connected_node(&shop, Service::Billing).await;
    down_and_back(&mut shop, "stop", on, "holding the billing worker's connection").await;
}

/// Take node `node` (1 to 3) down by `how` (`kill`: `kill -9`, or `stop`) mid-burst, check the
/// books, bring it back, check them again.
async fn down_and_back(shop: &mut Shop, how: &str, node: usize, why: &str) {
    cluster(&[how, &node.to_string()]).await;
    let down = Instant::now();
    shop.place_burst(30).await;
    if let Err(ledger) = shop.try_settle(RIDE_OUT).await {
        let queues = queues(shop).await;
        panic!(
            "the books did not settle within {RIDE_OUT:?} of `{how}` of rabbitc{node} ({why}):\n{ledger}\n{queues:?}"
        );
    }
    println!("cluster: rabbitc{node} ({why}) {how}; every order settled {:?} later", down.elapsed());
    shop.assert_books_balance().await;
    cluster(&["start"]).await;
    shop.place_burst(10).await;
    for service in Service::ALL {
        shop.wait_ready(service).await;
    }
    shop.assert_books_balance().await;
}

/// The node (1 to 3) `service`'s consumer is connected to, from its `/readyz` and its proxies (the
/// n-th proxy leads to node n).
async fn connected_node(shop: &Shop, service: Service) -> usize {
    let response = http::request("GET", &format!("{}/readyz", shop.http(service)), &[], None).await.expect("/readyz");
    let body: serde_json::Value = serde_json::from_slice(&response.body).expect("a readiness body");
    let on = body["brokerNodes"].as_object().and_then(|nodes| nodes.values().next()).and_then(|on| on.as_str());
    let on = on.unwrap_or_else(|| panic!("{service:?} names its node: {body}"));
    let proxies = shop.broker_proxies(service);
    1 + proxies.iter().position(|proxy| proxy.addr().to_string() == on).expect("one of its proxies")
}

/// Each queue of the test's vhost (name, messages ready, unacked, consumers, leader), as the
/// management API of the first node still up tells it.
async fn queues(shop: &Shop) -> Vec<(String, u64, u64, u64, String)> {
    let path = format!("/api/queues/{}", shop.env.vhost());
    let mut answered = None;
    for port in [15701, 15702, 15703] {
        let api = shop.env.management_url().replace(":15701", &format!(":{port}"));
        if let Ok(response) = http::request("GET", &http::join(&api, &path), &[], None).await {
            answered = Some(response);
            break;
        }
    }
    let Some(response) = answered else { return Vec::new() };
    let queues: Vec<serde_json::Value> = serde_json::from_slice(&response.body).unwrap_or_default();
    let number = |queue: &serde_json::Value, key: &str| queue[key].as_u64().unwrap_or_default();
    queues
        .iter()
        .map(|q| {
            let name = q["name"].as_str().unwrap_or_default().to_owned();
            let leader = q["leader"].as_str().unwrap_or_default().to_owned();
            (name, number(q, "messages_ready"), number(q, "messages_unacknowledged"), number(q, "consumers"), leader)
        })
        .collect()
}
