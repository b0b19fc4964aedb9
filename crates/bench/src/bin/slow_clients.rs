//! `slow_clients`: what the API's header timeout does to slowloris, in figures. On a shop of real
//! processes (the test kit's), measure ordinary `POST /orders` latency alone, then open CLIENTS
//! connections that each send their request headers one byte a second, measure the same load
//! again while they hang on, and report when the server cut each slow client off.
//!
//! `cargo run --release -p bench --bin slow_clients -- --clients 1000` (after `cargo build
//! --release --bins`), on the servers `DATABASE_URL` / `AMQP_URL` name.

use std::time::{Duration, Instant};

use clap::Parser;
use testkit::shop::{Options, Service, Shop};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    task::JoinSet,
};

#[derive(Debug, Parser)]
#[command(about = "Slow clients against the API's header timeout, with ordinary latency beside")]
struct Args {
    /// Connections that send their headers one byte a second.
    #[arg(long, default_value_t = 1000)]
    clients: usize,
    /// Ordinary orders per latency measurement.
    #[arg(long, default_value_t = 300)]
    orders: usize,
    /// Ordinary orders in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
}

/// p50, p99 and max of `samples`, in milliseconds.
fn spread(mut samples: Vec<Duration>) -> (f64, f64, f64) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1000.0;
    (at(0.5), at(0.99), at(1.0))
}

/// `orders` orders placed `concurrency` at a time; the latency of each.
async fn ordinary_load(api: &str, orders: usize, concurrency: usize) -> Vec<Duration> {
    let url = format!("{api}/orders");
    let body = r#"{"customerId":"slow-clients","lines":[{"sku":"SKU-1","quantity":1}]}"#;
    let mut latencies = Vec::with_capacity(orders);
    let mut running = JoinSet::new();
    for placed in 0..orders {
        if placed >= concurrency {
            latencies.push(running.join_next().await.expect("a task").expect("joined"));
        }
        let url = url.clone();
        running.spawn(async move {
            let started = Instant::now();
            let operator = testkit::auth::bearer(&testkit::auth::operator());
            let headers = [("Authorization", operator.as_str())];
            let response = testkit::http::request("POST", &url, &headers, Some(body)).await.expect("POST /orders");
            assert_eq!(response.status, 202, "{}", String::from_utf8_lossy(&response.body));
            started.elapsed()
        });
    }
    while let Some(latency) = running.join_next().await {
        latencies.push(latency.expect("joined"));
    }
    latencies
}

/// One slow client: connect, send a request's headers a byte a second; how long until the server
/// closed the connection (`None` if it was still open after `give_up`).
async fn slow_client(addr: String, give_up: Duration) -> Option<Duration> {
    let mut stream = TcpStream::connect(&addr).await.ok()?;
    let started = Instant::now();
    let request = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut buffer = [0u8; 256];
    for byte in request.iter().cycle() {
        if started.elapsed() > give_up {
            return None;
        }
        if stream.write_all(&[*byte]).await.is_err() {
            return Some(started.elapsed());
        }
        // Wait a second, unless the server closes (or answers: a 408) meanwhile.
        match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buffer)).await {
            Ok(Ok(0) | Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => {}
            Err(_) => {}
        }
    }
    None
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let shop = Shop::start(Options::default()).await;
    let api = shop.http(Service::Api).to_owned();
    let addr = api.trim_start_matches("http://").to_owned();
    // Warm up: connections, plans, the writers.
    ordinary_load(&api, 50, args.concurrency).await;

    let alone = spread(ordinary_load(&api, args.orders, args.concurrency).await);

    let give_up = Duration::from_secs(90);
    let mut slow = JoinSet::new();
    for _ in 0..args.clients {
        slow.spawn(slow_client(addr.clone(), give_up));
    }
    // Let them all connect and start trickling.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let beside = spread(ordinary_load(&api, args.orders, args.concurrency).await);

    let mut cut_off = Vec::new();
    let mut still_open = 0;
    while let Some(outcome) = slow.join_next().await {
        match outcome.expect("joined") {
            Some(after) => cut_off.push(after),
            None => still_open += 1,
        }
    }
    let cut = cut_off.len();
    let (cut_p50, cut_p99, cut_max) = if cut_off.is_empty() { (0.0, 0.0, 0.0) } else { spread(cut_off) };

    println!("slow clients against orders-api (HTTP_HEADER_TIMEOUT as shipped: 10s)");
    println!("  {:<44} {:>10} {:>10} {:>10}", "", "p50 ms", "p99 ms", "max ms");
    println!(
        "  {:<44} {:>10.1} {:>10.1} {:>10.1}",
        format!("POST /orders alone ({} orders)", args.orders),
        alone.0,
        alone.1,
        alone.2
    );
    println!(
        "  {:<44} {:>10.1} {:>10.1} {:>10.1}",
        format!("POST /orders beside {} slow clients", args.clients),
        beside.0,
        beside.1,
        beside.2
    );
    println!("  {:<44} {:>10.2} {:>10.2}", "ratio (beside / alone)", beside.0 / alone.0, beside.1 / alone.1);
    println!(
        "  {:<44} {:>10.0} {:>10.0} {:>10.0}",
        format!("slow client cut off after ({cut} of {})", args.clients),
        cut_p50,
        cut_p99,
        cut_max
    );
    println!("  slow clients still connected after {} s: {still_open}", give_up.as_secs());
    shop.stop().await;
}
