//! The transactional outbox and inbox over Postgres and RabbitMQ, as a library any service adopts:
//! the message envelope and what a contract is, broker topology, a confirmed publisher, the
//! consumer runtime (inbox, retries, parking, the crash bound), the outbox, its own database
//! tables ([`schema`]), and the runtime every binary starts through ([`service`]: flags, database
//! start-up, health, metrics, shutdown). It knows nothing of the services built on it: they bring
//! their own contracts, handlers and tables.
//!
//! The guarantees live here, once, so that a service only writes its handlers: see
//! `docs/adding-a-service.md` for a service built on it, `docs/architecture.md` for the flow and
//! `docs/guarantees.md` for the failure matrix.
//!
//! What a service's code calls (most of it in [`prelude`]):
//!
//! | module | for |
//! |---|---|
//! | [`contracts`] | what a message type is ([`contracts::Contract`]); the runtime's job events |
//! | [`topology`] | an endpoint: its queue, bindings, accepted types ([`topology::Endpoint`]) |
//! | [`consumer`] | typed handlers ([`consumer::Handle`], [`consumer::Routes`]) and how they fail |
//! | [`outbox`] | a message beside its effect, in the handler's transaction |
//! | [`service`] | the binary: [`service::Worker`] for one endpoint, [`service::Service`] for more |
//! | [`envelope`] | the message as it arrives ([`envelope::Incoming`]), for a raw handler |
//!
//! What the runtime is built from, public for binaries with a start-up of their own (the relay,
//! msgctl) and for the test kit: [`broker`], [`publisher`], [`db`], [`schema`], [`inbox`],
//! [`config`], [`health`], [`metrics`], [`serve`], [`http`], [`tls`], [`telemetry`], [`trace`],
//! [`shutdown`], [`backoff`], [`duration`], [`retention`], and [`failpoint`] (crash points for the
//! fault suite, inert unless `FAILPOINTS` is set).

pub mod backoff;
pub mod broker;
pub mod config;
pub mod consumer;
pub mod contracts;
pub(crate) mod crashes;
pub mod db;
pub mod duration;
pub mod envelope;
pub mod failpoint;
pub mod health;
pub mod http;
pub mod inbox;
pub mod metrics;
pub(crate) mod otel;
pub mod outbox;
pub mod publisher;
pub mod retention;
pub mod schema;
pub mod serve;
pub mod service;
pub mod shutdown;
mod startup;
pub mod telemetry;
pub mod tls;
pub mod topology;
pub mod trace;

/// What a service's code uses most: `use messaging::prelude::*;`.
pub mod prelude {
    pub use crate::{
        consumer::{Context, Handle, Handler, HandlerError, Reason, Routes},
        contracts::Contract,
        envelope::Incoming,
        outbox,
        service::{NoFlags, Worker},
        topology::Endpoint,
    };
}
