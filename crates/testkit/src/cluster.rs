//! The three-node RabbitMQ cluster of `.ci/rabbitmq-cluster`, driven through that script (which
//! `TEST_CLUSTER_CTL` names) and read through each node's management API: kill, stop, start,
//! partition and heal nodes, and find which node leads a queue. The cluster test and the soak's
//! node faults use it.

use std::time::Duration;

use crate::http;

/// The cluster, as the script names it.
#[derive(Debug, Clone)]
pub struct Cluster {
    ctl: String,
    /// Node n+1's name (`rabbit@rmqN`) and management API base URL, for n from 0.
    nodes: Vec<(String, String)>,
}

/// One queue of a vhost as the management API tells it.
#[derive(Debug, Clone)]
pub struct QueueState {
    /// Its name.
    pub name: String,
    /// Messages ready for delivery.
    pub ready: u64,
    /// Messages delivered and not yet acknowledged.
    pub unacked: u64,
    /// Its consumers.
    pub consumers: u64,
    /// The node that leads it (a quorum queue), `rabbit@rmqN`.
    pub leader: String,
}

/// How long a management API call may take: a partitioned node's answers nothing.
const ASK_TIMEOUT: Duration = Duration::from_secs(5);

impl Cluster {
    /// The cluster `TEST_CLUSTER_CTL` names; `None` when it is not set (a single broker).
    pub async fn from_env() -> Option<Self> {
        let ctl = std::env::var("TEST_CLUSTER_CTL").ok().filter(|ctl| !ctl.is_empty())?;
        let mut cluster = Self { ctl, nodes: Vec::new() };
        for node in 1..=3 {
            let name = cluster.run(&["name", &node.to_string()]).await;
            let management = cluster.run(&["management", &node.to_string()]).await;
            cluster.nodes.push((name, management));
        }
        Some(cluster)
    }

    /// How many nodes it has.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Never: a cluster has nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// `.ci/rabbitmq-cluster ARGS...`; its output. Panics if it fails.
    pub async fn run(&self, args: &[&str]) -> String {
        let output =
            tokio::process::Command::new(&self.ctl).args(args).output().await.expect("run the cluster's script");
        assert!(output.status.success(), "{} {}: {output:?}", self.ctl, args.join(" "));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// `rabbitmqctl ARGS...` beside node `node` (1 to 3), tried up to 10 times 2 s apart: for a
    /// command that must land on a node that may be busy rejoining its cluster. Its output;
    /// panics if every try failed.
    pub async fn ctl(&self, node: usize, args: &[&str]) -> String {
        let node = node.to_string();
        self.run(&[&["ctl-retrying", node.as_str()][..], args].concat()).await
    }

    /// `kill -9` of node `node` (1 to 3): a node that dies.
    pub async fn kill(&self, node: usize) {
        self.run(&["kill", &node.to_string()]).await;
    }

    /// Stop node `node` as an operator would (it hands its queues over first).
    pub async fn stop(&self, node: usize) {
        self.run(&["stop", &node.to_string()]).await;
    }

    /// Cut node `node` off from the other two and from every client; it keeps running.
    pub async fn partition(&self, node: usize) {
        self.run(&["partition", &node.to_string()]).await;
    }

    /// Start node `node` (1 to 3) alone, if it is down, and wait until it runs (and heal every
    /// partition).
    pub async fn start(&self, node: usize) {
        self.run(&["start", &node.to_string()]).await;
    }

    /// Heal every partition, start every node that is down, and wait until all three run in one
    /// cluster again.
    pub async fn restore(&self) {
        self.run(&["start"]).await;
    }

    /// The node number (1 to 3) of a node's name.
    pub fn node_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|(node, _)| node == name).map(|i| i + 1)
    }

    /// Node `node`'s name.
    pub fn name(&self, node: usize) -> &str {
        &self.nodes[node - 1].0
    }

    /// The queues of `vhost`, from the first node whose management API answers; empty if none does.
    pub async fn queues(&self, vhost: &str) -> Vec<QueueState> {
        let path = format!("/api/queues/{vhost}");
        for (_, management) in &self.nodes {
            let url = http::join(management, &path);
            let ask = http::request("GET", &url, &[], None);
            let Ok(Ok(response)) = tokio::time::timeout(ASK_TIMEOUT, ask).await else { continue };
            if response.status != 200 {
                continue;
            }
            let queues: Vec<serde_json::Value> = serde_json::from_slice(&response.body).unwrap_or_default();
            let text = |queue: &serde_json::Value, key: &str| queue[key].as_str().unwrap_or_default().to_owned();
            let number = |queue: &serde_json::Value, key: &str| queue[key].as_u64().unwrap_or_default();
            return queues
                .iter()
                .map(|q| QueueState {
                    name: text(q, "name"),
                    ready: number(q, "messages_ready"),
                    unacked: number(q, "messages_unacknowledged"),
                    consumers: number(q, "consumers"),
                    leader: text(q, "leader"),
                })
                .collect();
        }
        Vec::new()
    }

    /// The node (1 to 3) that leads quorum queue `queue` of `vhost`, if a node answers and knows.
    pub async fn leader(&self, vhost: &str, queue: &str) -> Option<usize> {
        let queues = self.queues(vhost).await;
        let leader = &queues.iter().find(|q| q.name == queue)?.leader;
        self.node_of(leader)
    }
}
