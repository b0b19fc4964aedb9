//! `billing-worker`: see the library for what it does.

fn main() -> Result<(), messaging::service::BoxError> {
    billing_worker::worker().main()
}
