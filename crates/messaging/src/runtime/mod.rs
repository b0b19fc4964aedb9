//! The runtime layer (decision 0027): what any of our processes is built from, knowing no message,
//! endpoint or outbox row. The broker side above it (the publisher, the consumer, the relay's side
//! of the outbox) and the service builder on top run on these parts; a service that starts through
//! the service builder calls none of them. They are public for binaries with a start-up of their
//! own (the relay and `msgctl`), for a service that adds its own HTTP routes or database work
//! (orders-api), and for the test kit; a namespace rather than a cargo feature, since the consumer
//! cannot run without them (decision 0015).
//!
//! | part | what it is |
//! |---|---|
//! | [`config`] | flags with environment fallbacks, `NAME_FILE` secrets, URLs that never print their password |
//! | [`broker`] | a broker session that reconnects with [`backoff`] and re-declares what it needs |
//! | [`db`] | database start-up (create, migrate, check grants), pools, bounded queries |
//! | [`health`], [`metrics`], [`serve`] | `/healthz`, `/readyz`, `/metrics` and the bounded HTTP server |
//! | [`problem`] | a failed request's `application/problem+json` answer |
//! | [`shutdown`] | one trigger, any number of tasks that stop taking work when it fires |
//! | [`telemetry`] | logs, and spans to a collector |
//! | [`tls`], [`http`] | rustls for every connection; the HTTP client for the management API and OTLP |
//! | [`duration`] | `250ms`, `5s`, `14d`, as the flags and queue names spell them |
//! | [`failpoint`] | named crash points for the fault suite, inert unless `FAILPOINTS` is set |
//! | [`startup`] | why a binary cannot start, and how its `main` ends |

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
pub mod problem;
pub mod serve;
pub mod shutdown;
pub mod startup;
pub mod telemetry;
pub mod tls;
