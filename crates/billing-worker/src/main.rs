//! `billing-worker`: see the library for what it does.

fn main() -> std::process::ExitCode {
    billing_worker::worker().main()
}
