//! Inventory: consumes `order.placed` and `order.ended` (endpoint `inventory.order-placed`, ordered
//! by key: an order's end after its placing). It reserves every line of a placed order or none,
//! and announces `inventory.reserved` or `inventory.rejected`; when the order ends, it settles the
//! reservation (invoiced) or releases it and announces `inventory.released` (any other end). Each
//! in the runtime's one transaction.

use std::collections::{BTreeMap, BTreeSet};

use messaging::prelude::*;
use shop::{End, InventoryRejected, InventoryReleased, InventoryReserved, OrderEnded, OrderLine, OrderPlaced};
use shop_demo::{Demo, DemoFaults};
use sqlx::{PgConnection, types::Json};
use uuid::Uuid;

/// This service's own migrations (`migrations/inventory`), applied after messaging's.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/inventory");

/// The worker: consumes `order.placed` and `order.ended` on endpoint `inventory.order-placed`.
pub fn worker() -> Worker<Demo, Routes<ReserveStock>> {
    Worker {
        name: "inventory-worker",
        about: "Reserves stock for placed orders, and settles or releases it when they end.",
        version: env!("CARGO_PKG_VERSION"),
        database: "inventory",
        http_addr: "127.0.0.1:8081",
        migrator: &MIGRATOR,
        // Ordered by key: an order's end is applied after its placing (shop::order_key).
        endpoint: shop::topology::inventory(),
        handler: |demo| handler(demo.faults),
        routes: None,
        // The demo's catalogue, if DEMO_CATALOGUE asks.
        prepare: Some(|demo, pool| Box::pin(demo.stock(pool))),
    }
}

/// The endpoint's handler: `order.placed` and `order.ended` to [`ReserveStock`], a batch's stock
/// rows for its placed orders locked first.
pub fn handler(faults: DemoFaults) -> Routes<ReserveStock> {
    Routes::new(ReserveStock { faults: faults.in_this_build() })
        .on::<OrderPlaced>()
        .on::<OrderEnded>()
        .lock_batches::<OrderPlaced>()
}

/// The handler of `order.placed` (reserve) and `order.ended` (settle or release).
#[derive(Debug, Clone, Default)]
pub struct ReserveStock {
    /// The demo's faults, if on.
    pub faults: DemoFaults,
}

/// What reserving an order came to.
enum Reservation {
    /// Stock taken, reservation written, `inventory.reserved` in the outbox.
    Made,
    Refused(String),
    /// The order was reserved before under another message id: nothing to do or announce.
    AlreadyMade,
}

impl Handle<OrderPlaced> for ReserveStock {
    async fn handle(&self, order: OrderPlaced, context: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        self.faults.apply(order.lines.iter().map(|line| line.sku.as_str()), context.attempt)?;
        let job_id = context.job_id;
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

// The order's end, as the orders service decided it: the held reservation is settled (the stock
// is sold) or released (the stock is back). The endpoint is ordered by key, so an order's end
// waits for its order.placed to be applied. But an order.placed parked at inventory gives up its
// place, and a redrive applies it late, after the end. So a release that finds no reservation
// leaves a fence, so that the order.placed reserves nothing when it comes: the two are safe in
// either order, and at the same time.
impl Handle<OrderEnded> for ReserveStock {
    async fn handle(&self, ended: OrderEnded, context: &Context, tx: &mut PgConnection) -> Result<(), HandlerError> {
        match ended.end {
            End::Invoiced => {
                // Invoiced means billing saw inventory.reserved: the reservation has committed.
                end_reservation(tx, ended.order_id, Ending::Settled).await?;
            }
            End::Declined | End::Cancelled => {
                // The fence first. If the order's reservation is being written by another
                // transaction right now, the insert waits for it to commit and then conflicts; the
                // release that follows, a statement of its own, sees it (READ COMMITTED takes a
                // snapshot per statement). Released first instead, it would find nothing, the
                // fence would conflict, and the stock would stay held.
                let fenced = sqlx::query(
                    "insert into reservations (id, order_id, job_id, lines, state, ended_at)
                     values ($1, $2, $3, '[]', 'released', now())
                     on conflict (order_id) do nothing",
                )
                .bind(Uuid::now_v7())
                .bind(ended.order_id)
                .bind(ended.job_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                if fenced == 0 {
                    end_reservation(tx, ended.order_id, Ending::Released).await?;
                }
                let released = InventoryReleased { order_id: ended.order_id, job_id: ended.job_id };
                outbox::enqueue(tx, &released, context.job_id).await?;
            }
        }
        Ok(())
    }
}

/// What a held reservation becomes when its order ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// Invoiced: its stock moves from `reserved` to `settled`.
    Settled,
    /// Any other end: its stock moves from `reserved` back to `available`.
    Released,
}

/// End the order's held reservation as `ending` says, and move its stock. An order without one
/// (never reserved, already ended, or fenced) changes nothing.
async fn end_reservation(tx: &mut PgConnection, order_id: Uuid, ending: Ending) -> Result<(), sqlx::Error> {
    let state = match ending {
        Ending::Settled => "settled",
        Ending::Released => "released",
    };
    let lines: Option<Json<Vec<OrderLine>>> = sqlx::query_scalar(
        "update reservations set state = $1, ended_at = now() where order_id = $2 and state = 'held' returning lines",
    )
    .bind(state)
    .bind(order_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(Json(lines)) = lines else {
        return Ok(());
    };
    // The reservation's lines are one per SKU, in SKU order (see `reserve`): its rows are locked in
    // that order, as every order's are.
    let skus: Vec<&str> = lines.iter().map(|line| line.sku.as_str()).collect();
    let quantities: Vec<i32> = lines.iter().map(|line| line.quantity).collect();
    sqlx::query("select 1 from stock where sku = any($1) order by sku for update")
        .bind(&skus)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "update stock set reserved = reserved - taken.quantity,
                available = available + case when $1 then taken.quantity else 0 end,
                settled = settled + case when $1 then 0 else taken.quantity end
           from unnest($2::text[], $3::int[]) as taken (sku, quantity)
          where stock.sku = taken.sku",
    )
    .bind(ending == Ending::Released)
    .bind(&skus)
    .bind(&quantities)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Stock rows are locked in SKU order, one order at a time, and orders share SKUs: two batches
/// handled together (two instances of this worker) would deadlock when one holds a SKU that the
/// other's next order needs and the other holds one of its own. So a batch's every SKU is locked
/// first, in SKU order, in one statement; each order's own lock then finds its rows held already.
impl LockBatch<OrderPlaced> for ReserveStock {
    async fn lock_batch(&self, orders: &[OrderPlaced], tx: &mut PgConnection) -> Result<(), HandlerError> {
        let skus: BTreeSet<&str> = orders.iter().flat_map(|order| &order.lines).map(|line| line.sku.as_str()).collect();
        let skus: Vec<&str> = skus.into_iter().collect();
        sqlx::query("select 1 from stock where sku = any($1) order by sku for update")
            .bind(&skus)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

/// Reserve all lines or none, in three round trips: lock the order's stock rows and read them,
/// write the reservation with its `inventory.reserved`, take the stock. A refusal is decided on
/// the locked rows before anything is written, so it needs no savepoint to undo, and the caller's
/// inbox row stays.
async fn reserve(tx: &mut PgConnection, order: &OrderPlaced, job_id: Option<Uuid>) -> Result<Reservation, sqlx::Error> {
    // Lines of the same SKU are merged, and rows are locked in SKU order, so two orders that share
    // SKUs always lock them in the same order and cannot deadlock.
    let mut wanted: BTreeMap<&str, i32> = BTreeMap::new();
    for line in &order.lines {
        *wanted.entry(line.sku.as_str()).or_default() += line.quantity;
    }
    let skus: Vec<&str> = wanted.keys().copied().collect();
    let available: BTreeMap<String, i32> =
        sqlx::query_as("select sku, available from stock where sku = any($1) order by sku for update")
            .bind(&skus)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect();
    let short = wanted.iter().find_map(|(sku, quantity)| match available.get(*sku) {
        None => Some(format!("unknown SKU {sku}")),
        Some(available) if available < quantity => {
            Some(format!("insufficient stock for {sku}: {quantity} requested, {available} available"))
        }
        Some(_) => None,
    });
    if let Some(reason) = short {
        // An order reserved before under another message id may have taken the last of the stock
        // itself: it is not refused now.
        let reserved: bool = sqlx::query_scalar("select exists (select 1 from reservations where order_id = $1)")
            .bind(order.order_id)
            .fetch_one(&mut *tx)
            .await?;
        return Ok(if reserved { Reservation::AlreadyMade } else { Reservation::Refused(reason) });
    }
    let reservation_id = Uuid::now_v7();
    let lines: Vec<OrderLine> =
        wanted.iter().map(|(sku, quantity)| OrderLine { sku: (*sku).to_owned(), quantity: *quantity }).collect();
    let reserved = InventoryReserved {
        order_id: order.order_id,
        job_id: order.job_id,
        reservation_id,
        lines: order.lines.clone(),
        deadline: order.deadline,
    };
    // The reservation and its `inventory.reserved` in one statement (one round trip). The outbox
    // row is selected from the inserted reservation, so an order reserved before under another
    // message id gets neither, and the statement's row count says which happened.
    let reservation = |effect: &mut sqlx::QueryBuilder<sqlx::Postgres>| {
        effect.push("insert into reservations (id, order_id, job_id, lines) values (");
        let mut values = effect.separated(", ");
        values.push_bind(reservation_id).push_bind(order.order_id).push_bind(order.job_id).push_bind(Json(&lines));
        effect.push(") on conflict (order_id) do nothing returning id");
    };
    let announced = outbox::Outgoing::of(&reserved, job_id);
    let written = outbox::with_effect(reservation, announced)?.build().execute(&mut *tx).await?;
    if written.rows_affected() == 0 {
        return Ok(Reservation::AlreadyMade);
    }
    // Every row is locked and holds enough: each line is taken, in one statement.
    let quantities: Vec<i32> = wanted.values().copied().collect();
    sqlx::query(
        "update stock set available = available - taken.quantity, reserved = reserved + taken.quantity
           from unnest($1::text[], $2::int[]) as taken (sku, quantity)
          where stock.sku = taken.sku",
    )
    .bind(&skus)
    .bind(&quantities)
    .execute(&mut *tx)
    .await?;
    Ok(Reservation::Made)
}
