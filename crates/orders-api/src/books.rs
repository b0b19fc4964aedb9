//! The books checked in production: every `BOOKS_INTERVAL`, the orders service compares its
//! orders with inventory's reservations and billing's invoices ([`shop_books`]) and exports the
//! count of each kind of disagreement as `books_disagreements{kind}` (alert `BooksDisagree`), and
//! whether the last check ran as `books_check_up` (alert `BooksCheckDown`). It is on unless
//! `BOOKS_CHECK=off`: `BOOKS_INVENTORY_URL` and `BOOKS_BILLING_URL` name the other two databases,
//! each through a read-only role, and default to the layout `ops/postgres/roles.sql` and compose
//! make (the `books` role, on the orders database's server, databases `inventory` and `billing`).
//! Where that guess does not reach, `books_check_up` is 0 and `BooksCheckDown` says so until the
//! URLs are set. Every session it opens on them is read-only besides. Its own database it reads
//! through the service's pool.

use std::time::Duration;

use messaging::runtime::{config::SecretUrl, duration::parse_duration, metrics::Metrics, shutdown::Shutdown};
use prometheus_client::metrics::{family::Family, gauge::Gauge};
use shop_books::{Books, Horizon, Kind};
use sqlx::PgPool;

/// The check's settings.
#[derive(Debug, Clone, clap::Args)]
pub struct BooksArgs {
    /// Whether the service checks the books: `off` only where the other databases are out of its
    /// reach for good (the alerts `BooksDisagree` and `BooksCheckDown` then never fire).
    #[arg(long, env = "BOOKS_CHECK", default_value = "on", value_parser = ["on", "off"])]
    pub books_check: String,
    /// The inventory database, through a read-only role (unset: role `books`, database
    /// `inventory`, on the server of `DATABASE_URL`).
    #[arg(long, env = "BOOKS_INVENTORY_URL", hide_env_values = true)]
    pub books_inventory_url: Option<SecretUrl>,
    /// The billing database, through a read-only role (unset: role `books`, database `billing`,
    /// on the server of `DATABASE_URL`).
    #[arg(long, env = "BOOKS_BILLING_URL", hide_env_values = true)]
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

/// Check the books every interval until `shutdown`, unless `BOOKS_CHECK=off`; an undecided
/// order holding stock past `deadline` (`ORDER_DEADLINE`) is a disagreement. `own` is the orders
/// database's URL, from which the other two are guessed where they are not named.
pub fn start(
    args: &BooksArgs,
    own: &SecretUrl,
    deadline: Duration,
    orders: PgPool,
    metrics: BooksMetrics,
    shutdown: Shutdown,
) -> Result<(), sqlx::Error> {
    if args.books_check == "off" {
        tracing::info!("the books are not checked (BOOKS_CHECK=off)");
        return Ok(());
    }
    let (inventory, billing) = match reader_urls(args, own) {
        Ok(urls) => urls,
        Err(error) => {
            // Not a reason to stop taking orders: the check says it cannot run, and pages.
            tracing::warn!(%error, "cannot check the books: set BOOKS_INVENTORY_URL and BOOKS_BILLING_URL, or BOOKS_CHECK=off");
            metrics.up.get_or_create(&Vec::new()).set(0);
            return Ok(());
        }
    };
    tracing::info!(%inventory, %billing, "checking the books every {:?}", args.books_interval);
    let read_only = |url: &SecretUrl| shop_books::read_only(url.expose(), Duration::from_secs(5));
    let books = Books { orders, inventory: read_only(&inventory)?, billing: read_only(&billing)? };
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

/// The inventory and billing databases through a read-only role: as named, or else guessed beside
/// `own`, the orders database's URL, through the `books` role.
pub fn reader_urls(args: &BooksArgs, own: &SecretUrl) -> Result<(SecretUrl, SecretUrl), sqlx::Error> {
    let url = |named: &Option<SecretUrl>, database: &str| match named {
        Some(url) => Ok(url.clone()),
        None => beside(own, database),
    };
    Ok((url(&args.books_inventory_url, "inventory")?, url(&args.books_billing_url, "billing")?))
}

/// The URL of `database` through the `books` role on the server `own` names, with its TLS and
/// other settings but nothing of the orders role's: not its user, password, client certificate or
/// session options. Refused for a URL without a host (a Unix socket given as `?host=`).
fn beside(own: &SecretUrl, database: &str) -> Result<SecretUrl, sqlx::Error> {
    let unparsable = |error: url::ParseError| sqlx::Error::Configuration(format!("DATABASE_URL: {error}").into());
    let mut url = url::Url::parse(own.expose()).map_err(unparsable)?;
    let kept: Vec<(String, String)> = url
        .query_pairs()
        .filter(|(key, _)| {
            !matches!(key.as_ref(), "user" | "password" | "dbname" | "sslcert" | "sslkey" | "options" | "passfile")
        })
        .map(|(key, value)| (key.into_owned(), value.into_owned()))
        .collect();
    url.query_pairs_mut().clear().extend_pairs(kept);
    if url.query() == Some("") {
        url.set_query(None);
    }
    let refused = |()| sqlx::Error::Configuration(format!("DATABASE_URL names no server: {own}").into());
    url.set_username("books").map_err(refused)?;
    url.set_password(None).map_err(refused)?;
    url.set_path(database);
    Ok(SecretUrl::new(url.to_string()))
}

async fn check(books: &Books, horizon: Horizon, metrics: &BooksMetrics) {
    match tokio::time::timeout(Duration::from_secs(30), books.check(horizon)).await {
        Ok(Ok(found)) => {
            metrics.up.get_or_create(&Vec::new()).set(1);
            for (kind, count) in shop_books::counts(&found) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_other_databases_are_guessed_beside_the_orders_database_through_the_books_role() {
        let own = SecretUrl::new("postgres://orders:secret@db.example:6432/orders?sslmode=verify-full&password=x");
        assert_eq!(
            beside(&own, "inventory").expect("a URL").expose(),
            "postgres://books@db.example:6432/inventory?sslmode=verify-full"
        );
        let bare = SecretUrl::new("postgres://orders@postgres/orders?sslcert=/run/orders.crt&sslkey=/run/orders.key");
        assert_eq!(beside(&bare, "billing").expect("a URL").expose(), "postgres://books@postgres/billing");
        assert!(beside(&SecretUrl::new("not a url"), "billing").is_err());
        assert!(beside(&SecretUrl::new("postgres:///orders?host=/run/postgresql"), "billing").is_err());
    }
}
