//! `msgctl books`: the shop's books, checked across its three databases ([`shop_books`]), one
//! disagreement per line. What the orders service counts in `books_disagreements`, listed.

use std::time::Duration;

use messaging::runtime::{config::SecretUrl, duration::parse_duration};
use shop_books::{Books, Horizon};

use crate::Failure;

/// Where the books are, and how far to look.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The orders database (a read-only role will do: every session is read-only).
    #[arg(long, env = "BOOKS_ORDERS_URL", hide_env_values = true)]
    orders_url: SecretUrl,
    /// The inventory database.
    #[arg(long, env = "BOOKS_INVENTORY_URL", hide_env_values = true)]
    inventory_url: SecretUrl,
    /// The billing database.
    #[arg(long, env = "BOOKS_BILLING_URL", hide_env_values = true)]
    billing_url: SecretUrl,
    /// Rows younger than this are left alone: their messages may still be on their way.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    grace: Duration,
    /// Reservations and invoices older than this are not read (held reservations always are).
    #[arg(long, default_value = "1d", value_parser = parse_duration)]
    window: Duration,
    /// How long an order may take (the orders service's `ORDER_DEADLINE`): an undecided order
    /// holding stock longer than this and the grace is listed.
    #[arg(long, env = "ORDER_DEADLINE", default_value = "30m", value_parser = parse_duration)]
    deadline: Duration,
    /// One JSON object per disagreement, one per line.
    #[arg(long)]
    json: bool,
}

/// List every disagreement; fail if there is one.
pub async fn run(args: Args) -> Result<(), Failure> {
    let pool = |url: &SecretUrl| shop_books::read_only(url.expose(), Duration::from_secs(10));
    let books = Books {
        orders: pool(&args.orders_url)?,
        inventory: pool(&args.inventory_url)?,
        billing: pool(&args.billing_url)?,
    };
    let found = books.check(Horizon { grace: args.grace, window: args.window, deadline: Some(args.deadline) }).await?;
    for disagreement in &found {
        if args.json {
            println!("{}", serde_json::to_string(disagreement)?);
        } else {
            println!("{disagreement}");
        }
    }
    match found.len() {
        0 => {
            if !args.json {
                println!("the books agree");
            }
            Ok(())
        }
        n => Err(Failure::Described(format!("{n} disagreement(s) between the books"))),
    }
}
