//! The shop's books, checked across its three databases (issue 41): what the tests' ledger checks
//! after a run, asked of a running shop. Each service keeps its own books, and nothing but
//! messages keeps them in step; this is how an operator learns that they are not. It reads the
//! services' tables, not their messages, so it is a crate of its own beside the contracts (`shop`).
//!
//! The rules, each over rows older than a grace period (an order ended a second ago may still be
//! compensating):
//! - an order that has ended holds no reservation ([`Kind::HeldByEnded`]);
//! - an invoice that stands belongs to an invoiced order ([`Kind::InvoiceNotInvoiced`]), for the
//!   orders that ended otherwise within a window (a day by default, `BOOKS_WINDOW`);
//! - a held reservation belongs to an order the orders service knows ([`Kind::UnknownOrder`]);
//! - an order's compensation is answered ([`Kind::CompensationOverdue`]);
//! - an order still undecided past its deadline holds no stock ([`Kind::HeldPastDeadline`]): its
//!   `order.deadline` was lost, or is stuck in the outbox;
//! - each SKU's `reserved` is what its held reservations hold ([`Kind::StockNotConserved`]);
//! - an invoiced order's invoice stands and its stock stays settled ([`Kind::InvoicedButVoid`],
//!   [`Kind::InvoicedButReleased`]), for the voids and releases within the window.
//!
//! Each query reads a partial index of the few rows that can disagree (held reservations, orders
//! that ended otherwise), never the tables that grow with every order. The orders service runs it
//! every `BOOKS_INTERVAL` and exports the counts (`books_disagreements`, alert `BooksDisagree`);
//! `msgctl books` lists them. It only reads: give it read-only roles, and open its sessions
//! read-only besides.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    time::Duration,
};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use uuid::Uuid;

/// A kind of disagreement between the services' books.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Inventory holds stock for an order that has ended: its release (or settle) was lost.
    HeldByEnded,
    /// Billing has a standing invoice for an order that did not end invoiced: its void was lost.
    InvoiceNotInvoiced,
    /// Inventory has a reservation for an order the orders service does not have (a failover that
    /// lost the order's commit after its message left, or a message from elsewhere).
    UnknownOrder,
    /// An order ended declined or cancelled, and an undo has not answered: a service is down, or
    /// the undo's message is parked (redrive it; abandoning it leaves the job compensating).
    CompensationOverdue,
    /// Inventory holds stock for an order that is still undecided past its deadline (and the
    /// grace): the deadline that would have ended it was lost, or waits in the outbox.
    HeldPastDeadline,
    /// A SKU's `reserved` is not the sum of what its held reservations hold: stock taken or given
    /// back outside a reservation's life (a hand edit, a bug). The disagreement names the SKU.
    StockNotConserved,
    /// An order ended invoiced, and billing voided its invoice: an undo ran for an order that did
    /// not end otherwise (a bug, a hand edit, a message from elsewhere).
    InvoicedButVoid,
    /// An order ended invoiced, and inventory released its reservation: the stock it sold is back
    /// on sale.
    InvoicedButReleased,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Self; 8] = [
        Self::HeldByEnded,
        Self::InvoiceNotInvoiced,
        Self::UnknownOrder,
        Self::CompensationOverdue,
        Self::HeldPastDeadline,
        Self::StockNotConserved,
        Self::InvoicedButVoid,
        Self::InvoicedButReleased,
    ];

    /// Its name, as the metric's `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::HeldByEnded => "held_by_ended",
            Self::InvoiceNotInvoiced => "invoice_not_invoiced",
            Self::UnknownOrder => "unknown_order",
            Self::CompensationOverdue => "compensation_overdue",
            Self::HeldPastDeadline => "held_past_deadline",
            Self::StockNotConserved => "stock_not_conserved",
            Self::InvoicedButVoid => "invoiced_but_void",
            Self::InvoicedButReleased => "invoiced_but_released",
        }
    }
}

/// One disagreement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Disagreement {
    /// What disagrees.
    pub kind: Kind,
    /// The order (none for [`Kind::StockNotConserved`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order_id: Option<Uuid>,
    /// The order's status in the orders database (none if it has no such order). For
    /// [`Kind::StockNotConserved`], what the SKU's rows say: `reserved R, held H`.
    pub status: Option<String>,
    /// The SKU (only for [`Kind::StockNotConserved`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sku: Option<String>,
    /// When the other service's row was written (for a SKU: when it was checked).
    pub since: DateTime<Utc>,
}

impl Disagreement {
    fn of_order(kind: Kind, order_id: Uuid, status: Option<String>, since: DateTime<Utc>) -> Self {
        Self { kind, order_id: Some(order_id), status, sku: None, since }
    }
}

impl fmt::Display for Disagreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.status.as_deref().unwrap_or("unknown");
        let what = match (&self.order_id, &self.sku) {
            (Some(order_id), _) => format!("order {order_id}"),
            (None, Some(sku)) => format!("sku {sku}"),
            (None, None) => String::new(),
        };
        write!(f, "{:<22} {what}  status {status:<10}  since {}", self.kind.as_str(), self.since)
    }
}

/// The three databases, each through a read-only role.
#[derive(Debug, Clone)]
pub struct Books {
    /// The orders database.
    pub orders: PgPool,
    /// The inventory database.
    pub inventory: PgPool,
    /// The billing database.
    pub billing: PgPool,
}

/// A pool of one connection on `url` whose sessions are all read-only (whatever the role may do),
/// connecting when first used and waiting at most `acquire_timeout` for it.
pub fn read_only(url: &str, acquire_timeout: Duration) -> sqlx::Result<PgPool> {
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    let options = options.options([("default_transaction_read_only", "on")]);
    Ok(sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        // A check every minute holds no connection between checks: a database's connection
        // slots are for its own service.
        .min_connections(0)
        .idle_timeout(Duration::from_secs(1))
        .acquire_timeout(acquire_timeout)
        .connect_lazy_with(options))
}

/// How far [`Books::check`] looks.
#[derive(Debug, Clone, Copy)]
pub struct Horizon {
    /// Rows younger than this are left alone: their messages may still be on their way.
    pub grace: Duration,
    /// Orders that ended otherwise than invoiced longer ago than this are not looked at again
    /// for a standing invoice. Held reservations are always read.
    pub window: Duration,
    /// How long an order may take (`ORDER_DEADLINE`): an undecided order that holds stock longer
    /// than this and the grace after it was placed is [`Kind::HeldPastDeadline`]. None: not checked.
    pub deadline: Option<Duration>,
}

impl Default for Horizon {
    fn default() -> Self {
        Self { grace: Duration::from_secs(60), window: Duration::from_secs(24 * 3600), deadline: None }
    }
}

/// An order's status, and when it last changed.
type OrderRow = (Uuid, String, DateTime<Utc>);

impl Books {
    /// Every disagreement, oldest first within each kind.
    pub async fn check(&self, horizon: Horizon) -> sqlx::Result<Vec<Disagreement>> {
        let grace = millis(horizon.grace);
        let window = millis(horizon.window);
        // The held reservations: the running orders' (partial index `reservations_held`).
        let held: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(
            "select order_id, created_at from reservations
              where state = 'held' and created_at < now() - $1 * interval '1 millisecond'",
        )
        .bind(grace)
        .fetch_all(&self.inventory)
        .await?;
        let ids: Vec<Uuid> = held.iter().map(|(id, _)| *id).collect();
        let orders: HashMap<Uuid, (String, DateTime<Utc>, DateTime<Utc>)> =
            sqlx::query_as::<_, (Uuid, String, DateTime<Utc>, DateTime<Utc>)>(
                "select id, status, updated_at, created_at from orders where id = any($1)",
            )
            .bind(&ids)
            .fetch_all(&self.orders)
            .await?
            .into_iter()
            .map(|(id, status, at, placed)| (id, (status, at, placed)))
            .collect();
        // The orders that ended otherwise than invoiced (partial index `orders_ended_otherwise`),
        // and any invoice of theirs that still stands.
        let ended_otherwise: Vec<OrderRow> = sqlx::query_as(
            "select id, status, updated_at from orders
              where status in ('rejected', 'declined', 'cancelled')
                and updated_at < now() - $1 * interval '1 millisecond'
                and updated_at > now() - $2 * interval '1 millisecond'",
        )
        .bind(grace)
        .bind(window)
        .fetch_all(&self.orders)
        .await?;
        let ids: Vec<Uuid> = ended_otherwise.iter().map(|(id, ..)| *id).collect();
        let standing: HashMap<Uuid, DateTime<Utc>> = sqlx::query_as::<_, (Uuid, DateTime<Utc>)>(
            "select order_id, created_at from invoices where order_id = any($1) and state = 'standing'",
        )
        .bind(&ids)
        .fetch_all(&self.billing)
        .await?
        .into_iter()
        .collect();

        // Compensations not answered (partial index `jobs_compensating`).
        let overdue: Vec<(Uuid, String, DateTime<Utc>)> = sqlx::query_as(
            "select j.order_id, o.status, j.updated_at from jobs j join orders o on o.id = j.order_id
              where j.state = 'compensating' and j.updated_at < now() - $1 * interval '1 millisecond'",
        )
        .bind(grace)
        .fetch_all(&self.orders)
        .await?;

        // The undos of the window (partial indexes `invoices_void`, `reservations_released`: few
        // rows), and which of their orders ended invoiced all the same.
        let within = |sql: &'static str, pool: PgPool| async move {
            sqlx::query_as::<_, (Uuid, DateTime<Utc>)>(sql).bind(grace).bind(window).fetch_all(&pool).await
        };
        let voided = within(
            "select order_id, voided_at from invoices
              where state = 'void'
                and voided_at < now() - $1 * interval '1 millisecond'
                and voided_at > now() - $2 * interval '1 millisecond'",
            self.billing.clone(),
        )
        .await?;
        let released = within(
            "select order_id, ended_at from reservations
              where state = 'released'
                and ended_at < now() - $1 * interval '1 millisecond'
                and ended_at > now() - $2 * interval '1 millisecond'",
            self.inventory.clone(),
        )
        .await?;
        let undone: Vec<Uuid> = voided.iter().chain(&released).map(|(id, _)| *id).collect();
        let invoiced: HashSet<Uuid> =
            sqlx::query_scalar("select id from orders where id = any($1) and status = 'invoiced'")
                .bind(&undone)
                .fetch_all(&self.orders)
                .await?
                .into_iter()
                .collect();

        // Each SKU's reserved stock against its held reservations', in one snapshot (a
        // reservation and its stock change in one transaction), a held SKU with no stock row
        // included. The catalogue and the held reservations are small.
        let unconserved: Vec<(String, i64, i64)> = sqlx::query_as(
            "with held as (
                 select line->>'sku' as sku, sum((line->>'quantity')::bigint) as quantity
                   from reservations r, jsonb_array_elements(r.lines) line
                  where r.state = 'held'
                  group by 1)
             select coalesce(s.sku, h.sku), coalesce(s.reserved, 0)::bigint, coalesce(h.quantity, 0)::bigint
               from stock s full join held h on h.sku = s.sku
              where coalesce(s.reserved, 0) <> coalesce(h.quantity, 0)
              order by 1",
        )
        .fetch_all(&self.inventory)
        .await?;

        let now = Utc::now();
        let settled_before = now - chrono::TimeDelta::milliseconds(grace);
        let placed_before =
            horizon.deadline.map(|deadline| settled_before - chrono::TimeDelta::milliseconds(millis(deadline)));
        let mut found = Vec::new();
        for (order_id, since) in held {
            match orders.get(&order_id) {
                None => found.push(Disagreement::of_order(Kind::UnknownOrder, order_id, None, since)),
                // An order that changed within the grace period may still be compensating.
                Some((status, at, _)) if is_final(status) && *at < settled_before => {
                    found.push(Disagreement::of_order(Kind::HeldByEnded, order_id, Some(status.clone()), since))
                }
                Some((status, _, placed))
                    if !is_final(status) && placed_before.is_some_and(|before| *placed < before) =>
                {
                    found.push(Disagreement::of_order(Kind::HeldPastDeadline, order_id, Some(status.clone()), since))
                }
                Some(_) => {}
            }
        }
        for (order_id, status, _) in ended_otherwise {
            if let Some(&since) = standing.get(&order_id) {
                found.push(Disagreement::of_order(Kind::InvoiceNotInvoiced, order_id, Some(status), since));
            }
        }
        for (order_id, status, since) in overdue {
            found.push(Disagreement::of_order(Kind::CompensationOverdue, order_id, Some(status), since));
        }
        let undos = [(Kind::InvoicedButVoid, voided), (Kind::InvoicedButReleased, released)];
        for (kind, rows) in undos {
            for (order_id, since) in rows.into_iter().filter(|(id, _)| invoiced.contains(id)) {
                found.push(Disagreement::of_order(kind, order_id, Some("invoiced".to_owned()), since));
            }
        }
        for (sku, reserved, held) in unconserved {
            let status = Some(format!("reserved {reserved}, held {held}"));
            found.push(Disagreement {
                kind: Kind::StockNotConserved,
                order_id: None,
                status,
                sku: Some(sku),
                since: now,
            });
        }
        found.sort_by_key(|disagreement| (disagreement.kind, disagreement.since));
        Ok(found)
    }
}

/// Whether an order's status is an end (the orders service's `OrderStatus::FINAL`).
fn is_final(status: &str) -> bool {
    ["invoiced", "rejected", "declined", "cancelled"].contains(&status)
}

/// How many of each kind `found` holds, every kind named.
pub fn counts(found: &[Disagreement]) -> Vec<(Kind, usize)> {
    Kind::ALL.map(|kind| (kind, found.iter().filter(|found| found.kind == kind).count())).to_vec()
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}
