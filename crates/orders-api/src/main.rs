//! `orders-api`: see the library for what it does; this is start-up only.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    messaging::telemetry::init();
    let config = orders_api::Config::parse();
    messaging::service::run_until_signal(config.http_addr, |listener, shutdown| {
        orders_api::run(config, listener, shutdown)
    })
    .await
}
