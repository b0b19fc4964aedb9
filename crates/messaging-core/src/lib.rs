//! The bottom layer of the messaging library (decision 0027): what a service's own code names.
//! A message type ([`contracts`]), the message as it travels ([`envelope`], [`trace`]), a handler
//! and how it fails ([`handler`], [`outage`]), and the rows a handler writes in its transaction:
//! the messages it sends ([`outbox`]) and the record of the messages it applied ([`inbox`]), in
//! tables this crate migrates ([`schema`]).
//!
//! It knows no broker connection, HTTP server, command line, metrics or telemetry exporter: those
//! are `messaging`'s, the layers above, which re-exports these modules. A crate of contracts and
//! business rules (the shop's `shop`) depends on this one alone.
//!
//! | module | for |
//! |---|---|
//! | [`contracts`] | what a message type is ([`contracts::Contract`]); the runtime's job events |
//! | [`endpoint`] | who consumes what: an endpoint's queues and bindings, a system's [`endpoint::Topology`] |
//! | [`envelope`] | a message's AMQP properties and headers; a delivery decoded ([`envelope::Incoming`]) |
//! | [`trace`] | the W3C trace context carried from hop to hop |
//! | [`handler`] | typed handlers ([`handler::Handle`], [`handler::Routes`]) and how they fail |
//! | [`outage`] | whether a database error is an outage to wait out |
//! | [`outbox`] | a message beside its effect, in the handler's transaction; the outbox's gauges |
//! | [`inbox`] | the exactly-once record, for a raw handler that writes it itself |
//! | [`schema`] | these tables, migrated before a service's own |

pub mod contracts;
pub mod endpoint;
pub mod envelope;
pub mod handler;
pub mod inbox;
pub mod outage;
pub mod outbox;
pub mod schema;
pub mod trace;
