//! Billing: consumes `inventory.reserved` and the `order.ended` of orders that ended declined or
//! cancelled (endpoint `billing.inventory-reserved`). It writes the invoice of a reserved order,
//! priced from its own `prices` table, and announces `invoice.created`, or declines the order
//! (`payment.declined`); when an order ends otherwise than invoiced, it voids its invoice and
//! announces `invoice.voided`. Each in the runtime's one transaction.

use std::collections::HashMap;

use chrono::Utc;
use messaging::prelude::*;
use shop::{End, InventoryReserved, InvoiceCreated, InvoiceVoided, OrderEnded, PaymentDeclined};
use shop_demo::{Demo, DemoFaults};
use sqlx::PgConnection;
use uuid::Uuid;

/// This service's own migrations (`migrations/billing`), applied after messaging's.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/billing");

/// The worker: consumes `inventory.reserved` and `order.ended` on endpoint
/// `billing.inventory-reserved`.
pub fn worker() -> Worker<Demo, Routes<CreateInvoice>> {
    Worker {
        name: "billing-worker",
        about: "Invoices reserved orders, and voids the invoices of orders that end otherwise.",
        version: env!("CARGO_PKG_VERSION"),
        database: "billing",
        http_addr: "127.0.0.1:8082",
        migrator: &MIGRATOR,
        endpoint: shop::topology::billing(),
        handler: |demo| handler(demo.faults),
        routes: None,
        // The demo's catalogue, if DEMO_CATALOGUE asks.
        prepare: Some(|demo, pool| Box::pin(demo.prices(pool))),
    }
}

/// The endpoint's handler: `inventory.reserved` and `order.ended` to [`CreateInvoice`].
pub fn handler(faults: DemoFaults) -> Routes<CreateInvoice> {
    Routes::new(CreateInvoice { faults: faults.in_this_build() }).on::<InventoryReserved>().on::<OrderEnded>()
}

/// The handler of `inventory.reserved` (invoice or decline) and `order.ended` (void).
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
        let skus: Vec<&str> = reserved.lines.iter().map(|line| line.sku.as_str()).collect();
        self.faults.apply(skus.iter().copied(), context.attempt)?;
        self.faults.apply_in_billing(skus.iter().copied(), context.attempt)?;
        // An order past its deadline has been cancelled, or is about to be: billing, started late,
        // invoices nothing for it (decision 0023).
        let expired = reserved.deadline.is_some_and(|deadline| deadline <= Utc::now());
        let refusal = if expired { Some(shop::EXPIRED.to_owned()) } else { self.faults.declines(skus.iter().copied()) };
        if let Some(reason) = refusal {
            let declined = PaymentDeclined { order_id: reserved.order_id, job_id: reserved.job_id, reason };
            outbox::enqueue(tx, &declined, context.job_id).await?;
            return Ok(());
        }
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
        // The invoice and its `invoice.created` in one statement (one round trip). The outbox row
        // is selected from the inserted invoice, so an order invoiced before under another message
        // id gets neither: it was announced then.
        let invoice = |effect: &mut sqlx::QueryBuilder<sqlx::Postgres>| {
            effect.push("insert into invoices (id, order_id, job_id, total_cents, lines) values (");
            effect
                .separated(", ")
                .push_bind(invoice_id)
                .push_bind(reserved.order_id)
                .push_bind(reserved.job_id)
                .push_bind(total_cents)
                .push_bind(sqlx::types::Json(&reserved.lines));
            effect.push(") on conflict (order_id) do nothing returning id");
        };
        let announced = outbox::Outgoing::of(&created, context.job_id);
        outbox::with_effect(invoice, announced)?.build().execute(&mut *tx).await?;
        Ok(())
    }
}

// An order that ended otherwise than invoiced has its invoice voided. A void that finds none,
// because the order's inventory.reserved is late or was never applied, leaves a fence instead, so
// that the inventory.reserved invoices nothing when it comes: the two are safe in either order,
// and at the same time. One statement does both: the fence's insert, or, on the order's invoice,
// the void. An invoice being written by another transaction right now is waited for, then voided
// (`on conflict do update` acts on the row as committed, not as this statement's snapshot saw it).
impl Handle<OrderEnded> for CreateInvoice {
    async fn handle(&self, ended: OrderEnded, context: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        // Not sent here any more (billing binds only the ends it undoes), but an earlier release's
        // `order.ended`, under the key every end had then, still comes during an upgrade.
        if ended.end == End::Invoiced {
            return Ok(());
        }
        sqlx::query(
            "insert into invoices (id, order_id, job_id, total_cents, lines, state, voided_at)
             values ($1, $2, $3, 0, '[]', 'void', now())
             on conflict (order_id) do update set state = 'void', voided_at = coalesce(invoices.voided_at, now())",
        )
        .bind(Uuid::now_v7())
        .bind(ended.order_id)
        .bind(ended.job_id)
        .execute(&mut *tx)
        .await?;
        let voided = InvoiceVoided { order_id: ended.order_id, job_id: ended.job_id };
        outbox::enqueue(tx, &voided, context.job_id).await?;
        Ok(())
    }
}
