//! What the service runtime ([`crate::service`]) is built from. A service that starts through
//! [`Worker`](crate::service::Worker) or [`Service`](crate::service::Service) calls none of this:
//! its code names contracts, endpoints, handlers and the outbox, and the runtime does the rest.
//! The parts are public for binaries with a start-up of their own (the relay and `msgctl`), for a
//! service that adds its own HTTP routes or database work (orders-api), and for the test kit; a
//! namespace rather than a cargo feature, since the consumer cannot run without them (decision
//! 0015).
//!
//! | part | what it is |
//! |---|---|
//! | [`config`] | flags with environment fallbacks, `NAME_FILE` secrets, URLs that never print their password |
//! | [`broker`] | a broker session that reconnects with [`backoff`] and re-declares what it needs |
//! | [`db`] | database start-up (create, migrate, check grants) and the outage/permanent split of errors |
//! | [`health`], [`metrics`], [`serve`] | `/healthz`, `/readyz`, `/metrics` and the bounded HTTP server |
//! | [`shutdown`] | one trigger, any number of tasks that stop taking work when it fires |
//! | [`telemetry`], [`trace`] | logs, W3C trace context from hop to hop, spans to a collector |
//! | [`tls`], [`http`] | rustls for every connection; the HTTP client for the management API and OTLP |
//! | [`retention`] | deleting rows that only matter for a while |
//! | [`duration`] | `250ms`, `5s`, `14d`, as the flags and queue names spell them |
//! | [`failpoint`] | named crash points for the fault suite, inert unless `FAILPOINTS` is set |

pub mod backoff;
pub mod broker;
pub mod config;
pub mod db;
pub mod duration;
pub mod failpoint;
pub mod health;
pub mod http;
pub mod metrics;
pub(crate) mod otel;
pub mod retention;
pub mod serve;
pub mod shutdown;
pub(crate) mod startup;
pub mod telemetry;
pub mod tls;
pub mod trace;
