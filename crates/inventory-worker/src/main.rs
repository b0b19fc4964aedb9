//! `inventory-worker`: see the library for what it does.

fn main() -> Result<(), messaging::service::BoxError> {
    inventory_worker::worker().main()
}
