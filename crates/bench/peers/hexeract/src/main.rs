//! hexeract (crates.io) as a peer relay for the bench (`crates/bench/src/peers.rs`).
//!
//! ```text
//! hexeract-peer fill  DATABASE_URL ROWS_FILE
//! hexeract-peer relay DATABASE_URL AMQP_URL QUEUE defaults|tuned
//! ```
//!
//! `fill` applies the library's schema (`ensure_schema`) and writes one row per line of ROWS_FILE
//! (JSON: the payload as text and the headers, the very rows our relay drains) through the
//! library's own `publish_in_tx`, 500 to a transaction. Its rows have no headers: the library's
//! envelope carries an id, a type and the payload.
//!
//! `relay` runs the library's outbox worker with a handler that hands each row's payload, id and
//! type to the library's RabbitMQ transport (`publish_raw`: persistent, mandatory, each publish
//! awaiting its confirm) for QUEUE, which the bench declared as a quorum queue. It runs until it
//! is stopped; the bench times it by the queue's depth.
//!
//! `defaults` is one worker with `OutboxWorkerConfig::default()`; `tuned` is what the library's
//! settings allow: larger batches, no pacing between full batches, a short poll, and eight
//! workers claiming with its leases side by side.

use std::{collections::HashMap, sync::Arc, time::Duration};

use hexeract::{
    bus::RawBusPublish,
    bus_rabbitmq::RabbitMqTransport,
    core::HandlerContext,
    outbox::{
        BoxFuture, ErasedHandler, Event, OutboxEnvelope, OutboxError, OutboxPublisher, OutboxWorker, OutboxWorkerConfig,
    },
    outbox_sql::{PgOutboxPublisher, PgOutboxStore, postgres::ensure_schema},
};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

const TABLE: &str = "outbox";
const EVENT_TYPE: &str = "order.placed";

/// A payload as it is: the library serializes it back to the same JSON.
#[derive(Serialize, Deserialize)]
#[serde(transparent)]
struct Payload(serde_json::Value);

impl Event for Payload {
    const EVENT_TYPE: &'static str = EVENT_TYPE;
}

#[derive(Deserialize)]
struct Row {
    payload: String,
}

/// Hands each row to the transport as it is stored: no decoding.
struct Forward {
    transport: Arc<RabbitMqTransport>,
    queue: String,
}

impl ErasedHandler for Forward {
    fn event_type(&self) -> &'static str {
        EVENT_TYPE
    }

    fn handle<'a>(
        &'a self,
        envelope: &'a OutboxEnvelope,
        _: &'a HandlerContext,
    ) -> BoxFuture<'a, Result<(), OutboxError>> {
        Box::pin(async move {
            self.transport
                .publish_raw(&self.queue, envelope.event_id, &envelope.event_type, &envelope.payload)
                .await
                .map_err(|error| OutboxError::Internal(error.to_string()))
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arguments: Vec<String> = std::env::args().skip(1).collect();
    match arguments.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["fill", database_url, rows_file] => fill(database_url, rows_file).await,
        ["relay", database_url, amqp_url, queue, setting] => relay(database_url, amqp_url, queue, setting).await,
        _ => Err("usage: hexeract-peer fill DATABASE_URL ROWS_FILE | relay DATABASE_URL AMQP_URL QUEUE defaults|tuned"
            .into()),
    }
}

async fn fill(database_url: &str, rows_file: &str) -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect(database_url).await?;
    ensure_schema(&pool, TABLE).await?;
    let publisher = PgOutboxPublisher::new(pool.clone(), TABLE)?;
    let rows = std::fs::read_to_string(rows_file)?
        .lines()
        .map(|line| Ok(Payload(serde_json::from_str(&serde_json::from_str::<Row>(line)?.payload)?)))
        .collect::<Result<Vec<_>, serde_json::Error>>()?;
    for chunk in rows.chunks(500) {
        let mut tx = pool.begin().await?;
        for row in chunk {
            publisher.publish_in_tx(&mut tx, row).await?;
        }
        tx.commit().await?;
    }
    println!("filled {}", rows.len());
    Ok(())
}

async fn relay(
    database_url: &str,
    amqp_url: &str,
    queue: &str,
    setting: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let (workers, config) = match setting {
        "defaults" => (1, OutboxWorkerConfig::default()),
        "tuned" => (
            8,
            OutboxWorkerConfig {
                batch_size: 256,
                poll_interval: Duration::from_millis(10),
                min_cycle_delay: Duration::ZERO,
                ..OutboxWorkerConfig::default()
            },
        ),
        other => return Err(format!("unknown setting {other}").into()),
    };
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(workers + 2).connect(database_url).await?;
    let transport = Arc::new(RabbitMqTransport::new(amqp_url).await?);
    let cancel = CancellationToken::new();
    let mut running = Vec::new();
    for _ in 0..workers {
        let forward: Arc<dyn ErasedHandler> =
            Arc::new(Forward { transport: Arc::clone(&transport), queue: queue.to_owned() });
        let handlers = HashMap::from([(EVENT_TYPE, forward)]);
        let worker = OutboxWorker::new(PgOutboxStore::new(pool.clone(), TABLE)?, handlers, config.clone());
        running.push(tokio::spawn(worker.run(cancel.clone())));
    }
    println!("relaying");
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = terminate.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    cancel.cancel();
    for worker in running {
        worker.await??;
    }
    Ok(())
}
