//! `relay`: see the library for what it does; this is start-up only.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = messaging::telemetry::init("relay");
    let config = relay::Config::parse();
    messaging::service::run_until_signal(config.http_addr, |listener, shutdown| relay::run(config, listener, shutdown))
        .await
}
