//! `msgctl`: operate what `messaging` leaves for people. Parked messages (list, show, redrive,
//! purge, abandon), outbox rows the broker keeps refusing (stuck, retry), and the shop's books
//! checked across its databases, and the broker topology declared as a deploy step. See
//! `docs/operations.md`.
//!
//! Nothing is lost if it is killed at any point: parked messages are read unacked and only the ones
//! it has dealt with are acked, after the broker confirmed their copy; the rest go back to parking
//! in their order when it ends, or when its connection dies.

mod books;
mod outbox;
mod topology;

use std::{process::ExitCode, time::Duration};

use clap::{CommandFactory, Parser, Subcommand};
use messaging::runtime::{
    config::{BrokerArgs, SecretUrl},
    duration::parse_duration,
};
use msgctl::{Failure, parked};

/// Operate messaging: parked messages and stuck outbox rows.
#[derive(Debug, Parser)]
#[command(name = "msgctl", version, about)]
struct Cli {
    #[command(flatten)]
    broker: BrokerArgs,
    /// Outbox databases for the `outbox` commands, comma-separated (the relay's list).
    #[arg(long = "database-url", env = "DATABASE_URL", hide_env_values = true, value_delimiter = ',')]
    database_urls: Vec<SecretUrl>,
    /// The consumers' databases, comma-separated, as a role that may read `inbox`: `parked
    /// redrive` says of each message whether its consumer applied it already. Default: the
    /// `--database-url` list (which the relay's role, limited to the outbox, cannot read).
    #[arg(long = "inbox-database-url", env = "INBOX_DATABASE_URL", hide_env_values = true, value_delimiter = ',')]
    inbox_database_urls: Vec<SecretUrl>,
    /// The RabbitMQ management API (`http://user:pass@host:15672`), used only to find the parking
    /// queues when no `--endpoint` is given. Default: the AMQP URL's host and user on port 15672.
    #[arg(long, env = "RABBITMQ_MANAGEMENT_URL", hide_env_values = true)]
    management_url: Option<SecretUrl>,
    /// How long the consumers keep inbox rows (their INBOX_RETENTION): a message parked longer ago
    /// than that may have been applied and forgotten, so `redrive` refuses it without `--force`.
    #[arg(long, env = "INBOX_RETENTION", default_value = "14d", value_parser = parse_duration)]
    inbox_retention: Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Messages in the endpoints' parking queues.
    Parked {
        #[command(subcommand)]
        action: parked::Action,
    },
    /// Outbox rows the broker keeps refusing.
    Outbox {
        #[command(subcommand)]
        action: outbox::Action,
    },
    /// The shop's books across its three databases: an ended order holding stock, a standing
    /// invoice of an order not invoiced, a reservation of an unknown order. Exit 1 if any.
    Books(books::Args),
    /// The shop's broker topology: declare it as a deploy step, or check what is missing.
    Topology {
        #[command(subcommand)]
        action: topology::Action,
    },
}

fn main() -> ExitCode {
    // Its settings may be given as files too (DATABASE_URL_FILE, AMQP_URL_FILE, ...).
    let cli = Cli::parse_from(messaging::service::command_line(&Cli::command()));
    if messaging::runtime::failpoint::ignored() {
        eprintln!("msgctl: FAILPOINTS is set, but this build has no failpoints (the feature `failpoints`): ignored");
    }
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("msgctl: cannot start: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Parked { action } => {
                let broker = parked::Broker { amqp_url: cli.broker.amqp_url, management_url: cli.management_url };
                let inboxes =
                    if cli.inbox_database_urls.is_empty() { &cli.database_urls } else { &cli.inbox_database_urls };
                parked::run(action, &broker, inboxes, cli.inbox_retention).await
            }
            Command::Outbox { action } => outbox::run(action, &cli.database_urls, &cli.broker.amqp_url).await,
            Command::Books(args) => books::run(args).await,
            Command::Topology { action } => topology::run(action, &cli.broker.amqp_url).await,
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("msgctl: {failure}");
            ExitCode::FAILURE
        }
    }
}
