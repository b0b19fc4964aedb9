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
//! The library is its core, the modules below, and the [`runtime`] they run on. What a service's
//! code calls (most of it in [`prelude`]):
//!
//! | module | for |
//! |---|---|
//! | [`contracts`] | what a message type is ([`contracts::Contract`]); the runtime's job events |
//! | [`topology`] | an endpoint: its queue, bindings, accepted types ([`topology::Endpoint`]) |
//! | [`consumer`] | typed handlers ([`consumer::Handle`], [`consumer::Routes`]) and how they fail |
//! | [`outbox`] | a message beside its effect, in the handler's transaction |
//! | [`service`] | the binary: [`service::Worker`] for one endpoint, [`service::Service`] for more |
//! | [`envelope`] | the message as it arrives ([`envelope::Incoming`]), for a raw handler |
//! | [`inbox`] | the exactly-once record, for a raw handler that writes it itself |
//! | [`publisher`] | a confirmed publish, for a binary that publishes outside the outbox |
//! | [`schema`] | messaging's own tables, migrated before a service's own |
//!
//! [`runtime`] holds what the service runtime is built from (flags, broker and database start-up,
//! health, metrics, HTTP, TLS, telemetry, shutdown, retention, failpoints): public for binaries
//! with a start-up of their own (the relay, `msgctl`) and for the test kit, and nothing a service
//! built on [`service`] needs to name.

pub mod consumer;
pub mod contracts;
pub mod envelope;
pub mod inbox;
pub mod outbox;
pub mod publisher;
pub mod runtime;
pub mod schema;
pub mod service;
pub mod topology;

/// What a service's code uses most: `use messaging::prelude::*;`.
pub mod prelude {
    pub use crate::{
        consumer::{Context, Handle, Handler, HandlerError, LockBatch, Reason, Routes},
        contracts::Contract,
        envelope::Incoming,
        outbox,
        service::{NoFlags, Worker},
        topology::Endpoint,
    };
}
