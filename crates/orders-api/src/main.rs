//! `orders-api`: see the library for what it does; this is start-up only.

use clap::CommandFactory;
use messaging::service;

fn main() -> std::process::ExitCode {
    let command = service::with_http_addr(orders_api::Config::command(), "127.0.0.1:8080");
    service::main("orders-api", service::with_database(command, "orders"), orders_api::run)
}
