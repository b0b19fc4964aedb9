//! Logging set-up shared by the binaries.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Structured logs to stderr, filtered by `RUST_LOG` (default `info`), coloured only on a
/// terminal so files and log collectors get plain text. Safe to call twice.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
