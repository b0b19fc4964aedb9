//! `shipping-worker`: see the library for what it does.

fn main() -> Result<(), messaging::service::BoxError> {
    shipping_worker::worker().main()
}
