//! `inventory-worker`: see the library for what it does; this is start-up only.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    messaging::telemetry::init();
    let config = inventory_worker::Config::parse();
    messaging::service::run_until_signal(config.http_addr, |listener, shutdown| {
        inventory_worker::run(config, listener, shutdown)
    })
    .await
}
