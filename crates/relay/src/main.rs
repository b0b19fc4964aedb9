//! `relay`: see the library for what it does; this is start-up only.

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use messaging::service;

fn main() -> ExitCode {
    let config = relay::Config::parse_from(service::command_line(&relay::Config::command()));
    let _telemetry = messaging::runtime::telemetry::init("relay");
    service::run_binary("relay", config.http_addr, |listener, shutdown| relay::run(config, listener, shutdown))
}
