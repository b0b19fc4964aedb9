//! `relay`: see the library for what it does; this is start-up only.

use clap::CommandFactory;
use messaging::service;

fn main() -> std::process::ExitCode {
    let command = service::with_http_addr(relay::Config::command(), "127.0.0.1:8083");
    service::main("relay", command, relay::run)
}
