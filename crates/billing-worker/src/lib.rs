//! Billing: consumes `inventory.reserved` (endpoint `billing.inventory-reserved`), writes the
//! invoice priced from its own `prices` table, and announces `invoice.created` through its outbox,
//! all in the runtime's one transaction.

use std::{collections::HashMap, net::SocketAddr};

use messaging::{
    config::{BrokerArgs, ConsumerArgs, SecretUrl},
    consumer::{ConsumerSettings, Handler, HandlerError},
    contracts::{InventoryReserved, InvoiceCreated, exchanges},
    envelope::Incoming,
    outbox,
    service::{Worker, demo_fault},
    topology::Endpoint,
};
use sqlx::PgConnection;
use uuid::Uuid;

/// This service's migrations (`migrations/billing`).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/billing");

/// `billing-worker`: invoices reserved orders.
#[derive(Debug, Clone, clap::Parser)]
#[command(version, about)]
pub struct Config {
    /// Postgres URL of the billing database (created and migrated at start-up).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@localhost:5432/billing"
    )]
    pub database_url: SecretUrl,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub broker: BrokerArgs,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "HTTP_ADDR", default_value = "0.0.0.0:8082")]
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
    Endpoint::new("billing.inventory-reserved")
        .bind(exchanges::INVENTORY, "inventory.reserved")
        .accept::<InventoryReserved>()
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
        database_label: "billing",
        consumer: ConsumerSettings::from_args(endpoint(), &config.consumer, &config.broker),
        handler: CreateInvoice { demo_faults: config.demo_faults },
    };
    worker.run(listener, shutdown).await?;
    Ok(())
}

/// The `inventory.reserved` handler.
#[derive(Debug, Clone, Default)]
pub struct CreateInvoice {
    /// Inject the demo faults.
    pub demo_faults: bool,
}

impl Handler for CreateInvoice {
    async fn handle(&self, message: &Incoming, tx: &mut PgConnection) -> Result<(), HandlerError> {
        let reserved: InventoryReserved = message.json()?;
        if self.demo_faults {
            demo_fault(reserved.lines.iter().map(|line| line.sku.as_str()), message.attempt())?;
        }
        let skus: Vec<&str> = reserved.lines.iter().map(|line| line.sku.as_str()).collect();
        let prices: HashMap<String, i64> =
            sqlx::query_as("select sku, unit_price_cents from prices where sku = any($1)")
                .bind(&skus)
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .collect();
        let mut total_cents: i64 = 0;
        for line in &reserved.lines {
            // Inventory only reserves SKUs it knows; a SKU without a price is a catalog bug that no
            // retry will fix, so the message is parked for a person to look at.
            let price = prices
                .get(&line.sku)
                .ok_or_else(|| HandlerError::Permanent(format!("no price for SKU {}", line.sku)))?;
            total_cents += price * i64::from(line.quantity);
        }
        let invoice_id = Uuid::now_v7();
        let inserted = sqlx::query(
            "insert into invoices (id, order_id, job_id, total_cents, lines) values ($1, $2, $3, $4, $5)
             on conflict (order_id) do nothing",
        )
        .bind(invoice_id)
        .bind(reserved.order_id)
        .bind(reserved.job_id)
        .bind(total_cents)
        .bind(sqlx::types::Json(&reserved.lines))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if inserted == 0 {
            // Invoiced before under another message id: it was announced then.
            return Ok(());
        }
        let created = InvoiceCreated { order_id: reserved.order_id, job_id: reserved.job_id, invoice_id, total_cents };
        outbox::enqueue(tx, &created, message.correlation_id.or(Some(reserved.job_id))).await?;
        Ok(())
    }
}
