//! The transactional outbox and inbox over Postgres and RabbitMQ, as a library any service adopts.
//! It knows nothing of the services built on it: they bring their own contracts, handlers and
//! tables. The guarantees live here, once, so that a service only writes its handlers: see
//! `docs/adding-a-service.md` for a service built on it, `docs/architecture.md` for the flow and
//! `docs/guarantees.md` for the failure matrix.
//!
//! It is built in layers, each naming only those below it (decision 0027; a test,
//! `tests/layers.rs`, fails if a module names one above):
//!
//! | layer | what it is |
//! |---|---|
//! | `messaging-core` (a crate of its own, re-exported here) | what a service's code names: [`contracts`], [`envelope`], [`handler`], the [`outbox`] and [`inbox`] writes, [`schema`], [`trace`], [`outage`] |
//! | [`runtime`] | what a process is built from: settings, database and broker connections, health, metrics, HTTP, TLS, telemetry, shutdown |
//! | [`topology`], [`publisher`], [`outbox_relay`], [`retention`] | the broker side: what to declare, a confirmed publish, the relay's side of the outbox, deleting what is past its retention |
//! | [`consumer`] | the consumer runtime: inbox, retries, parking, the crash bound, ordering by key |
//! | [`service`] | a binary: its settings, its endpoints and routes, one `main` |
//!
//! What a service's code calls is mostly in [`prelude`].

pub use messaging_core::{contracts, envelope, handler, inbox, outage, outbox, schema, trace};

pub mod consumer;
pub mod outbox_relay;
pub mod publisher;
pub mod retention;
pub mod runtime;
pub mod service;
pub mod topology;

/// What a service's code uses most: `use messaging::prelude::*;`.
pub mod prelude {
    pub use crate::{
        contracts::Contract,
        envelope::Incoming,
        handler::{Context, Handle, Handler, HandlerError, LockBatch, Reason, Routes},
        outbox,
        service::{NoFlags, Worker},
        topology::Endpoint,
    };
}
