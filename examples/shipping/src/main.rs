//! `shipping-worker`: see the library for what it does.

fn main() -> std::process::ExitCode {
    shipping_worker::worker().main()
}
