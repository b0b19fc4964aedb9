//! `orders-api`: see the library for what it does; this is start-up only.

use clap::{CommandFactory, Parser};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = orders_api::Config::parse();
    if let Err(refusal) = config.consumer.check_inbox_retention() {
        orders_api::Config::command().error(clap::error::ErrorKind::ValueValidation, refusal).exit();
    }
    let _telemetry = messaging::telemetry::init("orders-api");
    messaging::service::run_until_signal(config.http_addr, |listener, shutdown| {
        orders_api::run(config, listener, shutdown)
    })
    .await
}
