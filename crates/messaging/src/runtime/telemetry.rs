//! Logging and span export, set up once by each binary.

use std::io::IsTerminal;

use tracing_subscriber::{EnvFilter, Layer, filter::LevelFilter, layer::SubscriberExt, util::SubscriberInitExt};

use crate::runtime::otel;

/// What [`init`] started; keep it until the binary exits: dropping it sends the spans still
/// queued for the collector (within a few seconds).
#[derive(Debug)]
#[must_use = "dropping it stops span export"]
pub struct Telemetry {
    _exporter: Option<otel::Exporter>,
}

/// Structured logs to stderr, filtered by `RUST_LOG` (default `info`), coloured only on a
/// terminal so files and log collectors get plain text; and, if the `OTEL_*` variables name a
/// collector, every traced span to it (`otel`, whatever `RUST_LOG` says). `service` is the
/// default `service.name`. A second call changes nothing.
///
/// `OTEL_*` variables this exporter cannot honour are a start-up error: it prints one line that
/// names the variable and exits with status 2, as a bad flag does.
pub fn init(service: &str) -> Telemetry {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter);
    let config = otel::Config::from_env(service).unwrap_or_else(|refusal| {
        eprintln!("{service}: {refusal}");
        std::process::exit(2)
    });
    let (spans, exporter) = match config.map(otel::start).transpose() {
        Ok(Some((layer, exporter))) => (Some(layer.with_filter(LevelFilter::INFO)), Some(exporter)),
        Ok(None) => (None, None),
        Err(error) => {
            eprintln!("{service}: cannot start the span exporter: {error}");
            std::process::exit(2)
        }
    };
    let exporting = exporter.is_some();
    if tracing_subscriber::registry().with(logs).with(spans).try_init().is_ok() && exporting {
        tracing::info!("exporting spans over OTLP (OTEL_* variables)");
    }
    Telemetry { _exporter: exporter }
}
