//! The books checked in production: every `BOOKS_INTERVAL`, the orders service compares its
//! orders with inventory's reservations and billing's invoices ([`shop::books`]) and exports the
//! count of each kind of disagreement as `books_disagreements{kind}` (alert `BooksDisagree`), and
//! whether the last check ran as `books_check_up` (alert `BooksCheckDown`). Off unless
//! `BOOKS_INVENTORY_URL` and `BOOKS_BILLING_URL` name the other two databases, each through a
//! read-only role; every session it opens on them is read-only besides. Its own
//! database it reads through the service's pool.

use std::time::Duration;

use messaging::runtime::{config::SecretUrl, duration::parse_duration, metrics::Metrics, shutdown::Shutdown};
use prometheus_client::metrics::{family::Family, gauge::Gauge};
use shop::books::{Books, Horizon, Kind};
use sqlx::PgPool;

/// The check's settings.
#[derive(Debug, Clone, clap::Args)]
pub struct BooksArgs {
    /// The inventory database, through a read-only role: with `BOOKS_BILLING_URL`, the service
    /// checks the shop's books against it (unset: not checked).
    #[arg(long, env = "BOOKS_INVENTORY_URL", hide_env_values = true, requires = "books_billing_url")]
    pub books_inventory_url: Option<SecretUrl>,
    /// The billing database, through a read-only role (with `BOOKS_INVENTORY_URL`).
    #[arg(long, env = "BOOKS_BILLING_URL", hide_env_values = true, requires = "books_inventory_url")]
    pub books_billing_url: Option<SecretUrl>,
    /// How often the books are checked.
    #[arg(long, env = "BOOKS_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub books_interval: Duration,
    /// Rows younger than this are not checked: their messages may still be on their way.
    #[arg(long, env = "BOOKS_GRACE", default_value = "60s", value_parser = parse_duration)]
    pub books_grace: Duration,
    /// Orders that ended declined, cancelled or rejected longer ago than this are not looked at
    /// again for a standing invoice (held reservations are always read).
    #[arg(long, env = "BOOKS_WINDOW", default_value = "1d", value_parser = parse_duration)]
    pub books_window: Duration,
}

/// `books_disagreements`, one gauge per kind, and `books_check_up`.
#[derive(Debug, Clone)]
pub struct BooksMetrics {
    disagreements: Family<[(&'static str, &'static str); 1], Gauge>,
    /// One series without labels, created by the first check: absent where the books are not
    /// checked, so that `BooksCheckDown` cannot fire there.
    up: Family<Vec<(String, String)>, Gauge>,
}

impl BooksMetrics {
    /// Register `books_disagreements` beside the runtime's metrics.
    pub fn register(metrics: &mut Metrics) -> Self {
        let disagreements = Family::default();
        metrics.register(
            "books_disagreements",
            "Disagreements between the services' books, by kind, at the last check",
            disagreements.clone(),
        );
        let up = Family::default();
        metrics.register(
            "books_check_up",
            "1 if the last check of the books ran, 0 if it failed (a database that does not answer, a role without \
             its grants): books_disagreements is absent meanwhile",
            up.clone(),
        );
        Self { disagreements, up }
    }
}

/// Check the books every interval until `shutdown`, if the other databases are named; an
/// undecided order holding stock past `deadline` (`ORDER_DEADLINE`) is a disagreement.
pub fn start(
    args: &BooksArgs,
    deadline: Duration,
    orders: PgPool,
    metrics: BooksMetrics,
    shutdown: Shutdown,
) -> Result<(), sqlx::Error> {
    let (Some(inventory), Some(billing)) = (&args.books_inventory_url, &args.books_billing_url) else {
        return Ok(());
    };
    let read_only = |url: &SecretUrl| shop::books::read_only(url.expose(), Duration::from_secs(5));
    let books = Books { orders, inventory: read_only(inventory)?, billing: read_only(billing)? };
    let horizon = Horizon { grace: args.books_grace, window: args.books_window, deadline: Some(deadline) };
    let interval = args.books_interval;
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = shutdown.triggered() => return,
            }
            check(&books, horizon, &metrics).await;
        }
    });
    Ok(())
}

async fn check(books: &Books, horizon: Horizon, metrics: &BooksMetrics) {
    match tokio::time::timeout(Duration::from_secs(30), books.check(horizon)).await {
        Ok(Ok(found)) => {
            metrics.up.get_or_create(&Vec::new()).set(1);
            for (kind, count) in shop::books::counts(&found) {
                metrics.disagreements.get_or_create(&[("kind", kind.as_str())]).set(count as i64);
            }
            if !found.is_empty() {
                tracing::warn!(disagreements = found.len(), first = %found[0], "the books disagree: msgctl books lists them");
            }
        }
        outcome => {
            // No figure rather than a stale one: while the check fails, the series is absent,
            // `books_check_up` is 0, and the log says why.
            metrics.up.get_or_create(&Vec::new()).set(0);
            for kind in Kind::ALL {
                metrics.disagreements.remove(&[("kind", kind.as_str())]);
            }
            let error = match outcome {
                Ok(Err(error)) => error.to_string(),
                _ => "no answer within 30 s".to_owned(),
            };
            tracing::warn!(%error, "cannot check the books");
        }
    }
}
