//! `inventory-worker`: see the library for what it does.

fn main() -> std::process::ExitCode {
    inventory_worker::worker().main()
}
