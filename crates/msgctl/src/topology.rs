//! `msgctl topology`: the shop's broker topology ([`shop::topology::shop`]), declared as a deploy
//! step before any service publishes (`apply`), or compared with the broker's (`check`). Decision
//! 0030: the way migrations come before code, the queues a message is meant for exist before the
//! first message, so a service that starts last misses nothing.

use messaging::{
    runtime::{broker, config::BrokerNodes},
    topology::{self, Topology},
};

use crate::Failure;

/// What to do with the topology.
#[derive(Debug, clap::Subcommand)]
pub enum Action {
    /// Declare the shop's exchanges, and each endpoint's queues and bindings (not its retry wait
    /// queues, which follow its own `RETRY_DELAYS`). Idempotent: run it on every deploy, before
    /// the services, with a broker user that may configure them (`topology` in
    /// `ops/rabbitmq/users.sh`).
    Apply {
        /// The work queues' delivery limit, as the services declare it (their `DELIVERY_LIMIT`):
        /// a queue's arguments cannot change once declared, so the step and the services must
        /// agree, or the later one is refused (`PRECONDITION_FAILED`).
        #[arg(long, env = "DELIVERY_LIMIT", default_value_t = topology::DEFAULT_DELIVERY_LIMIT,
              value_parser = clap::value_parser!(u32).range(1..))]
        delivery_limit: u32,
    },
    /// List the exchanges and work queues of the shop's topology that the broker does not have;
    /// exit 1 if any. Run it as `topology`: RabbitMQ 4.3 answers a lookup only to a user with
    /// some permission on the name. Bindings cannot be looked up over AMQP: `apply` makes
    /// them again.
    Check,
}

/// Apply or check the shop's topology on the broker at `nodes`.
pub async fn run(action: Action, nodes: &BrokerNodes) -> Result<(), Failure> {
    let (connection, _) = broker::connect_any(nodes, 0, "msgctl")
        .await
        .map_err(|error| Failure::Described(format!("cannot reach the broker at {nodes}: {error}")))?;
    let mut shop = shop::topology::shop();
    let outcome = match action {
        Action::Apply { delivery_limit } => {
            for endpoint in &mut shop.endpoints {
                endpoint.delivery_limit = delivery_limit;
            }
            apply(&connection, &shop).await
        }
        Action::Check => check(&connection, &shop).await,
    };
    let _ = connection.close(200, "bye".into()).await;
    outcome
}

async fn apply(connection: &lapin::Connection, shop: &Topology) -> Result<(), Failure> {
    topology::declare_topology(connection, shop).await.map_err(|error| {
        Failure::Described(format!(
            "cannot declare the topology: {error} (may this broker user configure the shop's exchanges and \
             queues? ops/rabbitmq/users.sh gives that to `topology`)"
        ))
    })?;
    println!("exchanges: {}", shop.exchanges.join(", "));
    for endpoint in &shop.endpoints {
        let bindings: Vec<String> =
            endpoint.bindings.iter().map(|binding| format!("{} {}", binding.exchange, binding.routing_key)).collect();
        println!("{}: declared, bound to {}", endpoint.name, bindings.join(", "));
    }
    Ok(())
}

async fn check(connection: &lapin::Connection, shop: &Topology) -> Result<(), Failure> {
    let exchanges = topology::missing_exchanges(connection, &shop.exchanges).await?;
    let names: Vec<&str> = shop.endpoints.iter().map(|endpoint| endpoint.name).collect();
    let queues = topology::missing_queues(connection, &names).await?;
    for exchange in &exchanges {
        println!("missing exchange {exchange}");
    }
    for queue in &queues {
        println!("missing queue {queue}");
    }
    match exchanges.len() + queues.len() {
        0 => {
            println!("the topology is declared");
            Ok(())
        }
        missing => Err(Failure::Described(format!(
            "{missing} of the topology's exchanges and queues are missing: the relay holds the messages meant for \
             them; run `msgctl topology apply`"
        ))),
    }
}
