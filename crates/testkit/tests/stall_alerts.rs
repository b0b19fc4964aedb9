//! A stall that lasts pages someone (issue 56, row 4): inventory's database refuses writes for
//! longer than the alerts' setting, and a real Prometheus, scraping the shop's services with the
//! shipped rules (`ops/prometheus/alerts.yml`, unchanged), fires `ReadinessCheckFailing` for that
//! database and `DeliveriesHeldByAnOutage` for inventory's consumer: not before the setting's
//! five minutes, and within a minute after. Once writes are taken again every order succeeds and
//! both alerts resolve.
//!
//! `promtool test rules` (in `.ci/run`) proves each rule on series written by hand; this proves
//! them on the series the services really export through such an outage, with the time the rules
//! really take. It takes about six minutes, so the README's test command skips it: `.ci/run` runs
//! it in the cluster lane, `just stall-alerts` by hand. It needs Prometheus (Debian's
//! `prometheus`, or the binary `PROMETHEUS` names).

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use serde_json::Value;
use testkit::{
    eventually, http,
    process::free_port,
    shop::{Options, Service, Shop, WAIT},
};
use tokio::time::Instant;

/// The setting both alerts share: `readiness_failing_seconds > 300` and `for: 5m`.
const SETTING: Duration = Duration::from_secs(300);

/// How soon after the setting each must fire: a scrape, an evaluation and the rule's own `for`
/// step, every 2 s here, with the noisy machine's margin.
const FIRES_WITHIN: Duration = Duration::from_secs(60);

/// A Prometheus of the test's own, in its own directory, killed when dropped.
struct Prometheus {
    url: String,
    process: tokio::process::Child,
}

impl Prometheus {
    /// Scrape every instance of `shop` every 2 s and evaluate the shipped rules every 2 s.
    async fn start(shop: &Shop) -> Self {
        let binary = std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".to_owned());
        let dir = shop.log_dir().join("prometheus");
        std::fs::create_dir_all(&dir).expect("create Prometheus's directory");
        let targets: Vec<String> = shop
            .instances()
            .into_iter()
            .map(|instance| format!("\"{}\"", shop.http(instance).trim_start_matches("http://")))
            .collect();
        let config = format!(
            "global: {{ scrape_interval: 2s, evaluation_interval: 2s }}\n\
             rule_files: [\"{rules}\"]\n\
             scrape_configs:\n  - job_name: shop\n    static_configs:\n      - targets: [{targets}]\n",
            rules = rules_file().display(),
            targets = targets.join(", "),
        );
        let config_file = dir.join("prometheus.yml");
        std::fs::write(&config_file, config).expect("write Prometheus's configuration");
        let address = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("create Prometheus's log");
        let process = tokio::process::Command::new(&binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={address}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "start {binary}: {error}. This test needs Prometheus: install Debian's `prometheus`, \
                     or name the binary in PROMETHEUS"
                )
            });
        let mut prometheus = Self { url: format!("http://{address}"), process };
        let log = dir.join("prometheus.log");
        let deadline = Instant::now() + WAIT;
        loop {
            let ready = http::request("GET", &format!("{}/-/ready", prometheus.url), &[], None).await;
            if ready.is_ok_and(|response| response.status == 200) {
                return prometheus;
            }
            if let Some(status) = prometheus.process.try_wait().expect("Prometheus's status") {
                panic!("Prometheus exited ({status}) before it was ready: see {}", log.display());
            }
            assert!(Instant::now() < deadline, "Prometheus not ready after {WAIT:?}: see {}", log.display());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `GET /api/v1/{path}`'s `data`.
    async fn api(&self, path: &str) -> Value {
        let response =
            http::request("GET", &format!("{}/api/v1/{path}", self.url), &[], None).await.expect("Prometheus answers");
        assert_eq!(response.status, 200, "{path}: {}", String::from_utf8_lossy(&response.body));
        let body: Value = serde_json::from_slice(&response.body).expect("Prometheus answers JSON");
        body["data"].clone()
    }

    /// The alerts firing now, with their labels.
    async fn firing(&self) -> Vec<Value> {
        let alerts = self.api("alerts").await;
        let alerts = alerts["alerts"].as_array().expect("alerts").clone();
        alerts.into_iter().filter(|alert| alert["state"] == "firing").map(|alert| alert["labels"].clone()).collect()
    }
}

/// The rules users deploy.
fn rules_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/prometheus/alerts.yml").canonicalize().expect("alerts.yml")
}

/// Each firing alert as `name instance label`, the label being the one it is about (`check`,
/// `endpoint`), so that a failure shows every alert at once.
fn described(firing: &[Value]) -> BTreeSet<String> {
    firing
        .iter()
        .map(|labels| {
            let about = labels["check"].as_str().or(labels["endpoint"].as_str()).unwrap_or("");
            format!(
                "{} {} {about}",
                labels["alertname"].as_str().unwrap_or("?"),
                labels["instance"].as_str().unwrap_or("?")
            )
        })
        .collect()
}

#[tokio::test]
#[ignore = "about six minutes, and Prometheus: .ci/run's cluster lane, or `just stall-alerts`"]
async fn a_database_read_only_past_the_alerts_setting_pages_and_every_order_ends_once_it_takes_writes() {
    let mut shop = Shop::start(Options::default()).await;
    let prometheus = Prometheus::start(&shop).await;
    let inventory = shop.http(Service::Inventory).trim_start_matches("http://").to_owned();
    eventually("Prometheus to scrape every service", WAIT, || async {
        let targets = prometheus.api("targets").await;
        let active = targets["activeTargets"].as_array().cloned().unwrap_or_default();
        (active.len() == shop.instances().len() && active.iter().all(|target| target["health"] == "up")).then_some(())
    })
    .await;
    let before = shop.place(&[("SKU-1", 1)]).await;
    shop.wait_for_state(before, "succeeded").await;
    assert_eq!(described(&prometheus.firing().await), BTreeSet::new(), "nothing pages while all is well");

    // Taken before the stall begins, so that no page can come sooner than the setting after it.
    let stalled_at = Instant::now();
    shop.env.read_only("inventory", true).await;
    // Orders are still taken (the API's database takes writes); inventory holds their deliveries.
    let mut jobs = Vec::new();
    for _ in 0..5 {
        jobs.push(shop.place(&[("SKU-2", 1)]).await);
    }

    // Neither alert fires before the setting; both fire for inventory within a minute after it.
    const PAGES: [&str; 2] = ["ReadinessCheckFailing", "DeliveriesHeldByAnOutage"];
    let ours = |labels: &Value| PAGES.contains(&labels["alertname"].as_str().unwrap_or(""));
    let fires_for_inventory = |firing: &[Value], name: &str| {
        firing.iter().any(|labels| labels["alertname"] == name && labels["instance"] == inventory.as_str())
    };
    let deadline = stalled_at + SETTING + FIRES_WITHIN;
    let firing = loop {
        let firing = prometheus.firing().await;
        if stalled_at.elapsed() < SETTING {
            let early = firing.iter().any(ours);
            assert!(!early, "paged {:?} after {:?}, before the setting", described(&firing), stalled_at.elapsed());
        } else if PAGES.iter().all(|name| fires_for_inventory(&firing, name)) {
            println!("paged {:?} into the stall: {:?}", stalled_at.elapsed(), described(&firing));
            break firing;
        }
        assert!(
            Instant::now() < deadline,
            "not paged {:?} into the stall: firing {:?}",
            stalled_at.elapsed(),
            described(&firing)
        );
        // Every job still waits for inventory: held, not retried or parked.
        for &job in &jobs {
            let state = shop.job(job).await;
            assert!(matches!(state["state"].as_str(), Some("queued" | "published")), "held, not spent: {state}");
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    // Only inventory's database is named (the worker's `database:inventory`; the relay labels it
    // by its database's name, here the test's `t_<id>_inventory`): the orders' and billing's
    // checks pass.
    for labels in &firing {
        if labels["alertname"] == "ReadinessCheckFailing" {
            let check = labels["check"].as_str().unwrap_or("");
            let inventorys = check.starts_with("database:") && check.ends_with("inventory");
            assert!(inventorys, "{:?}", described(&firing));
        }
    }

    // Writes again: every order ends, and the pages resolve by themselves.
    shop.env.read_only("inventory", false).await;
    for &job in &jobs {
        shop.wait_for_state(job, "succeeded").await;
    }
    eventually("the pages to resolve", WAIT, || async { (!prometheus.firing().await.iter().any(ours)).then_some(()) })
        .await;
    let ledger = shop.assert_books_balance().await;
    assert_eq!(ledger.quarantined, 0, "{ledger}");
}
