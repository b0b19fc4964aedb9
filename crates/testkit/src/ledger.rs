//! The shop's books, read straight from its three databases: what the crash tests and the soak
//! check at the end. Every number is a query, so a failure says which guarantee broke.

use std::{collections::BTreeMap, fmt};

use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

/// `available + reserved + settled` per SKU (`reserved` is what reservations hold), taken before
/// the load starts. A release before the saga has no `settled` (the upgrade suite starts one).
pub async fn stock_totals(inventory: &PgPool) -> BTreeMap<String, i64> {
    sqlx::query_as::<_, (String, i64)>(
        "select sku, (available + reserved + coalesce((to_jsonb(s) ->> 'settled')::bigint, 0))::bigint from stock s",
    )
    .fetch_all(inventory)
    .await
    .expect("read stock")
    .into_iter()
    .collect()
}

/// The job moves the model forbids, as the orders database counted them (migration 0014's
/// trigger, which `job_moves_forbidden_total` exports): each `(from, to, moves)`.
pub async fn forbidden_job_moves(orders: &PgPool) -> Vec<(String, String, i64)> {
    sqlx::query_as("select from_state, to_state, moves from job_moves_forbidden order by 1, 2")
        .fetch_all(orders)
        .await
        .expect("read job_moves_forbidden")
}

/// The outcome of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ledger {
    /// Orders the API answered 202 for.
    pub accepted: usize,
    /// Accepted orders with no job row: lost by the API.
    pub lost: usize,
    /// Jobs by terminal state.
    pub succeeded: i64,
    /// Refused for stock or SKU.
    pub rejected: i64,
    /// Refused by billing, and compensated.
    pub declined: i64,
    /// Cancelled (by the customer, the deadline or an operator), and compensated.
    pub cancelled: i64,
    /// Parked after retries or as poison.
    pub quarantined: i64,
    /// Accepted but neither final nor quarantined (compensating included).
    pub stuck: i64,
    /// Reservations and invoices beyond one per order, reserved or settled quantities beyond the
    /// held or settled reservations' lines, and effects on orders that were rejected.
    pub duplicated_effects: i64,
    /// Reservations still held by orders that have ended: the stock an ended order did not give
    /// back (or, for an invoiced one, has not settled yet).
    pub held_by_ended: i64,
    /// SKUs where `available + reserved + settled` differs from the start.
    pub stock_not_conserved: Vec<String>,
    /// Outbox rows, in the three databases, that the relay has not marked published: a settled
    /// shop has none (a relay that cannot mark republishes its rows for ever, which the inboxes
    /// absorb and the other figures would not show).
    pub unpublished: i64,
    /// Invoices written.
    pub invoices: i64,
    /// Succeeded orders without a standing invoice, plus standing invoices for orders that did
    /// not succeed (a declined or cancelled order's invoice must be void).
    pub invoice_mismatches: i64,
}

impl Ledger {
    /// Read the books. `accepted` are the job ids the API returned; `initial` is
    /// [`stock_totals`] from before the run.
    pub async fn read(
        orders: &PgPool,
        inventory: &PgPool,
        billing: &PgPool,
        accepted: &[Uuid],
        initial: &BTreeMap<String, i64>,
    ) -> Self {
        let found: i64 = sqlx::query_scalar("select count(*) from jobs where id = any($1)")
            .bind(accepted)
            .fetch_one(orders)
            .await
            .expect("count accepted jobs");
        let states: BTreeMap<String, i64> = sqlx::query_as("select state, count(*) from jobs group by state")
            .fetch_all(orders)
            .await
            .expect("jobs by state")
            .into_iter()
            .collect();
        let state = |name: &str| states.get(name).copied().unwrap_or(0);
        let stuck = state("queued") + state("published") + state("retry_wait") + state("compensating");

        let succeeded_orders = order_ids(orders, "select order_id from jobs where state = 'succeeded'").await;
        let rejected_orders = order_ids(orders, "select order_id from jobs where state = 'rejected'").await;
        let invoiced = order_ids(billing, "select order_id from invoices where state = 'standing'").await;
        let ended = order_ids(
            orders,
            "select order_id from jobs where state in ('succeeded', 'rejected', 'declined', 'cancelled')",
        )
        .await;
        let held = order_ids(inventory, "select order_id from reservations where state = 'held'").await;
        let held_by_ended = held.iter().filter(|id| ended.contains(id)).count() as i64;
        let reserved = order_ids(inventory, "select order_id from reservations where state <> 'released'").await;

        let mut duplicated_effects =
            extra_rows(inventory, "reservations").await + extra_rows(billing, "invoices").await;
        // Stock reserved (settled) must be exactly what the held (settled) reservations list: a
        // reservation applied, released or settled twice shows here even if its row was written
        // once.
        let over_reserved: i64 = sqlx::query_scalar(
            "select coalesce(sum(abs(s.reserved - coalesce(r.held, 0)) + abs(s.settled - coalesce(r.settled, 0))), 0)::bigint
             from stock s
             left join (select line->>'sku' as sku,
                               sum((line->>'quantity')::bigint) filter (where state = 'held') as held,
                               sum((line->>'quantity')::bigint) filter (where state = 'settled') as settled
                          from reservations, jsonb_array_elements(lines) as line group by 1) r on r.sku = s.sku",
        )
        .fetch_one(inventory)
        .await
        .expect("compare reserved stock with reservations");
        duplicated_effects += over_reserved;
        duplicated_effects +=
            rejected_orders.iter().filter(|id| reserved.contains(id) || invoiced.contains(id)).count() as i64;

        let now = stock_totals(inventory).await;
        let stock_not_conserved = initial
            .iter()
            .filter(|(sku, total)| now.get(*sku) != Some(total))
            .map(|(sku, total)| format!("{sku}: {total} -> {:?}", now.get(sku)))
            .collect();

        let mut unpublished = 0;
        for pool in [orders, inventory, billing] {
            // A scheduled row (an order's deadline) waits by design until it is due.
            let rows: i64 = sqlx::query_scalar(
                "select count(*) from outbox where published_at is null and (not scheduled or available_at <= now())",
            )
            .fetch_one(pool)
            .await
            .expect("count unpublished outbox rows");
            unpublished += rows;
        }

        let invoice_mismatches = succeeded_orders.iter().filter(|id| !invoiced.contains(id)).count()
            + invoiced.iter().filter(|id| !succeeded_orders.contains(id)).count();

        Self {
            accepted: accepted.len(),
            lost: accepted.len().saturating_sub(usize::try_from(found).unwrap_or(0)),
            succeeded: state("succeeded"),
            rejected: state("rejected"),
            declined: state("declined"),
            cancelled: state("cancelled"),
            quarantined: state("quarantined"),
            stuck,
            duplicated_effects,
            held_by_ended,
            stock_not_conserved,
            unpublished,
            invoices: invoiced.len() as i64,
            invoice_mismatches: invoice_mismatches as i64,
        }
    }

    /// Whether the shop has come to rest: every accepted order ended or quarantined, its
    /// compensations done and its reservation settled or released, every outbox drained (the last
    /// step's events may still be on their way when its job ends).
    pub fn is_settled(&self) -> bool {
        self.stuck == 0 && self.lost == 0 && self.unpublished == 0 && self.held_by_ended == 0
    }

    /// Nothing lost, stuck or applied twice; no stock held by an ended order; stock conserved; one
    /// standing invoice per succeeded order and none for any other.
    pub fn is_clean(&self) -> bool {
        self.lost == 0
            && self.stuck == 0
            && self.duplicated_effects == 0
            && self.held_by_ended == 0
            && self.stock_not_conserved.is_empty()
            && self.unpublished == 0
            && self.invoice_mismatches == 0
    }
}

async fn order_ids(pool: &PgPool, sql: &'static str) -> std::collections::HashSet<Uuid> {
    sqlx::query_scalar(sql).fetch_all(pool).await.expect(sql).into_iter().collect()
}

/// Rows beyond one per order (the unique constraint should make this 0; the ledger checks anyway).
async fn extra_rows(pool: &PgPool, table: &str) -> i64 {
    // `table` is one of the ledger's own names, never input.
    let sql = format!("select count(*) - count(distinct order_id) from {table}");
    sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await.expect("count extra rows")
}

impl fmt::Display for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let conserved = if self.stock_not_conserved.is_empty() {
            "yes".to_owned()
        } else {
            format!("NO ({})", self.stock_not_conserved.join(", "))
        };
        writeln!(f, "accepted            {:>8}", self.accepted)?;
        writeln!(f, "  succeeded         {:>8}", self.succeeded)?;
        writeln!(f, "  rejected          {:>8}", self.rejected)?;
        writeln!(f, "  declined          {:>8}", self.declined)?;
        writeln!(f, "  cancelled         {:>8}", self.cancelled)?;
        writeln!(f, "  quarantined       {:>8}", self.quarantined)?;
        writeln!(f, "  stuck             {:>8}", self.stuck)?;
        writeln!(f, "lost                {:>8}", self.lost)?;
        writeln!(f, "duplicated effects  {:>8}", self.duplicated_effects)?;
        writeln!(f, "held by ended       {:>8}", self.held_by_ended)?;
        writeln!(f, "outbox unpublished  {:>8}", self.unpublished)?;
        writeln!(
            f,
            "invoices            {:>8}  (mismatched with succeeded: {})",
            self.invoices, self.invoice_mismatches
        )?;
        write!(f, "stock conserved     {conserved:>8}")
    }
}
