//! `orders-api`: see the library for what it does; this is start-up only.

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use messaging::service;

fn main() -> ExitCode {
    let config = orders_api::Config::parse_from(service::command_line(&orders_api::Config::command()));
    if let Err(refusal) = config.consumer.check_inbox_retention() {
        orders_api::Config::command().error(clap::error::ErrorKind::ValueValidation, refusal).exit();
    }
    let _telemetry = messaging::runtime::telemetry::init("orders-api");
    service::run_binary("orders-api", config.http_addr, |listener, shutdown| {
        orders_api::run(config, listener, shutdown)
    })
}
