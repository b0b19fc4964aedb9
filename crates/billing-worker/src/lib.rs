//! Billing: consumes `inventory.reserved` (endpoint `billing.inventory-reserved`), writes the
//! invoice priced from its own `prices` table, and announces `invoice.created` through its outbox,
//! all in the runtime's one transaction.

use std::{collections::HashMap, sync::LazyLock};

use messaging::prelude::*;
use shop::{InventoryReserved, InvoiceCreated, demo::DemoFaults};
use sqlx::PgConnection;
use uuid::Uuid;

/// This service's own migrations (`migrations/billing`), applied after messaging's.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/billing");

/// The worker: consumes `inventory.reserved` on endpoint `billing.inventory-reserved`.
pub fn worker() -> Worker<DemoFaults, Routes<CreateInvoice>> {
    Worker {
        name: "billing-worker",
        about: "Invoices reserved orders.",
        version: env!("CARGO_PKG_VERSION"),
        database: "billing",
        http_addr: "127.0.0.1:8082",
        migrator: &MIGRATOR,
        endpoint: Endpoint::new("billing.inventory-reserved").consume::<InventoryReserved>(),
        handler: |faults| handler(*faults),
    }
}

/// The endpoint's handler: `inventory.reserved` to [`CreateInvoice`].
pub fn handler(faults: DemoFaults) -> Routes<CreateInvoice> {
    Routes::new(CreateInvoice { faults }).on::<InventoryReserved>()
}

/// The invoice and its `invoice.created` in one statement (one round trip). The outbox row is
/// selected from the inserted invoice, so an order invoiced before under another message id gets
/// neither: it was announced then.
static INSERT_INVOICE: LazyLock<outbox::WithEffect> = LazyLock::new(|| {
    outbox::WithEffect::new(
        "insert into invoices (id, order_id, job_id, total_cents, lines) values ($1, $2, $3, $4, $5)
         on conflict (order_id) do nothing
         returning id",
    )
});

/// The `inventory.reserved` handler.
#[derive(Debug, Clone, Default)]
pub struct CreateInvoice {
    /// The demo's faults, if on.
    pub faults: DemoFaults,
}

impl Handle<InventoryReserved> for CreateInvoice {
    async fn handle(
        &self,
        reserved: InventoryReserved,
        context: &Context,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.faults.apply(reserved.lines.iter().map(|line| line.sku.as_str()), context.attempt)?;
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
                .ok_or_else(|| HandlerError::Permanent(format!("no price for SKU {}", line.sku).into()))?;
            total_cents += price * i64::from(line.quantity);
        }
        let invoice_id = Uuid::now_v7();
        let created = InvoiceCreated { order_id: reserved.order_id, job_id: reserved.job_id, invoice_id, total_cents };
        let announced = outbox::Outgoing::of(&created, context.job_id);
        INSERT_INVOICE
            .query(
                |effect| {
                    effect
                        .bind(invoice_id)
                        .bind(reserved.order_id)
                        .bind(reserved.job_id)
                        .bind(total_cents)
                        .bind(sqlx::types::Json(&reserved.lines))
                },
                announced,
            )
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}
