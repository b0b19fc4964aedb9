//! Messaging building blocks shared by every service of the shop: the message envelope and its
//! contracts, broker topology, a confirmed publisher, the consumer runtime (inbox, retries, parking),
//! the outbox and the inbox, plus the plumbing every binary needs (database start-up, health,
//! metrics, shutdown, configuration).
//!
//! The guarantees live here, once, so that a service only writes its handler: see
//! `docs/architecture.md` for the flow and `docs/guarantees.md` for the failure matrix.

pub mod backoff;
pub mod broker;
pub mod config;
pub mod consumer;
pub mod contracts;
pub mod crashes;
pub mod db;
pub mod duration;
pub mod envelope;
pub mod failpoint;
pub mod health;
pub mod inbox;
pub mod metrics;
pub mod outbox;
pub mod publisher;
pub mod service;
pub mod shutdown;
pub mod telemetry;
pub mod topology;
