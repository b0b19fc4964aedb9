//! Inventory: consumes `order.placed` (endpoint `inventory.order-placed`) and reserves every line
//! of the order or none, then announces `inventory.reserved` or `inventory.rejected` through its
//! outbox, all in the runtime's one transaction.

use std::{collections::BTreeMap, net::SocketAddr};

use messaging::{
    config::{BrokerArgs, ConsumerArgs, SecretUrl},
    consumer::{ConsumerSettings, Handler, HandlerError},
    contracts::{InventoryRejected, InventoryReserved, OrderLine, OrderPlaced, exchanges},
    envelope::Incoming,
    outbox,
    service::{Worker, demo_fault},
    topology::Endpoint,
};
use sqlx::{Acquire, PgConnection};
use uuid::Uuid;

/// This service's migrations (`migrations/inventory`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/inventory");

/// `inventory-worker`: reserves stock for placed orders.
#[derive(Debug, Clone, clap::Parser)]
#[command(version, about)]
pub struct Config {
    /// Postgres URL of the inventory database (created and migrated at start-up).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@localhost:5432/inventory"
    )]
    pub database_url: SecretUrl,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub broker: BrokerArgs,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "HTTP_ADDR", default_value = "0.0.0.0:8081")]
    pub http_addr: SocketAddr,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub consumer: ConsumerArgs,
    /// Demo fault injection: FLAKY* SKUs fail twice, POISON* SKUs always, CRASH* SKUs make the
    /// process exit (1/0, true/false).
    #[arg(long, env = "DEMO_FAULTS", default_value = "false", action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub demo_faults: bool,
}

/// The endpoint this worker consumes.
pub fn endpoint() -> Endpoint {
    Endpoint::new("inventory.order-placed").bind(exchanges::ORDERS, "order.placed").accept::<OrderPlaced>()
}

/// Run the worker until `shutdown`, with its health endpoints on `listener`.
pub async fn run(
    config: Config,
    listener: tokio::net::TcpListener,
    shutdown: messaging::shutdown::Shutdown,
) -> anyhow::Result<()> {
    let worker = Worker {
        database_url: config.database_url,
        migrator: &MIGRATOR,
        database_label: "inventory",
        consumer: ConsumerSettings::from_args(endpoint(), &config.consumer, &config.broker),
        handler: ReserveStock { demo_faults: config.demo_faults },
    };
    worker.run(listener, shutdown).await?;
    Ok(())
}

/// The `order.placed` handler.
#[derive(Debug, Clone, Default)]
pub struct ReserveStock {
    /// Inject the demo faults.
    pub demo_faults: bool,
}

/// What reserving an order came to.
enum Reservation {
    /// Stock taken, reservation written, `inventory.reserved` in the outbox.
    Made,
    Refused(String),
    /// The order was reserved before under another message id: nothing to do or announce.
    AlreadyMade,
}

impl Handler for ReserveStock {
    async fn handle(&self, message: &Incoming, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let order: OrderPlaced = message.json()?;
        if self.demo_faults {
            demo_fault(order.lines.iter().map(|line| line.sku.as_str()), message.attempt())?;
        }
        let job_id = message.correlation_id.or(Some(order.job_id));
        match reserve(tx, &order, job_id).await? {
            Reservation::Made | Reservation::AlreadyMade => {}
            Reservation::Refused(reason) => {
                // The delivery's span already names the message, its job and its attempt.
                tracing::info!(%reason, "order refused");
                let rejected = InventoryRejected { order_id: order.order_id, job_id: order.job_id, reason };
                outbox::enqueue(tx, &rejected, job_id).await?;
            }
        }
        Ok(())
    }
}

/// Reserve all lines or none, inside a savepoint so a refusal undoes everything it wrote while
/// the caller's inbox row stays.
///
/// Every order touches a few hot stock rows, so their locks are taken last: the reservation and
/// the `inventory.reserved` outbox row are written first (a refusal rolls them back with the
/// savepoint), and a row lock is held only for the remaining updates and the commit.
async fn reserve(tx: &mut PgConnection, order: &OrderPlaced, job_id: Option<Uuid>) -> Result<Reservation, sqlx::Error> {
    // Lines of the same SKU are merged, and rows are locked in SKU order, so two orders that share
    // SKUs always lock them in the same order and cannot deadlock.
    let mut wanted: BTreeMap<&str, i32> = BTreeMap::new();
    for line in &order.lines {
        *wanted.entry(line.sku.as_str()).or_default() += line.quantity;
    }
    let mut savepoint = tx.begin().await?;
    let reservation_id = Uuid::now_v7();
    let lines: Vec<OrderLine> =
        wanted.iter().map(|(sku, quantity)| OrderLine { sku: (*sku).to_owned(), quantity: *quantity }).collect();
    let inserted = sqlx::query(
        "insert into reservations (id, order_id, job_id, lines) values ($1, $2, $3, $4)
         on conflict (order_id) do nothing",
    )
    .bind(reservation_id)
    .bind(order.order_id)
    .bind(order.job_id)
    .bind(sqlx::types::Json(&lines))
    .execute(&mut *savepoint)
    .await?
    .rows_affected();
    if inserted == 0 {
        savepoint.rollback().await?;
        return Ok(Reservation::AlreadyMade);
    }
    let reserved = InventoryReserved {
        order_id: order.order_id,
        job_id: order.job_id,
        reservation_id,
        lines: order.lines.clone(),
    };
    outbox::enqueue(&mut savepoint, &reserved, job_id).await?;
    for (sku, quantity) in &wanted {
        let taken = sqlx::query(
            "update stock set available = available - $2, reserved = reserved + $2
              where sku = $1 and available >= $2",
        )
        .bind(sku)
        .bind(quantity)
        .execute(&mut *savepoint)
        .await?
        .rows_affected();
        if taken == 0 {
            let available: Option<i32> = sqlx::query_scalar("select available from stock where sku = $1")
                .bind(sku)
                .fetch_optional(&mut *savepoint)
                .await?;
            // Undoes the reservation, the outbox row and the lines already taken, and releases
            // their row locks.
            savepoint.rollback().await?;
            let reason = match available {
                None => format!("unknown SKU {sku}"),
                Some(available) => format!("insufficient stock for {sku}: {quantity} requested, {available} available"),
            };
            return Ok(Reservation::Refused(reason));
        }
    }
    savepoint.commit().await?;
    Ok(Reservation::Made)
}
