//! The machine's tests: plain instants, no runtime, no database, no broker. The decision table's
//! rows are tested on [`Decision`](super::decision::Decision) itself (`decision.rs`); these test
//! what the machine adds: what starts when, the batch and its fallback, waits and the session's
//! end.

mod batches;
mod scheduling;
mod waits;

use std::time::{Duration, Instant};

use messaging_core::handler::HandlerError;

use super::{Action, Applied, Arrival, Input, Machine, Rules, Settlement, Tag};
use crate::{consumer::Batching, runtime::backoff::Backoff, topology::RetryPolicy};

/// Waits drawn at the top of their range: exactly 100, 200, 400 ms.
fn rules() -> Rules {
    Rules {
        policy: RetryPolicy::new(vec![Duration::from_secs(5), Duration::from_secs(30)], 3),
        max_crashes: 2,
        reconnect: Backoff::new(Duration::from_millis(100), Duration::from_secs(10)),
        draw: || 1.0,
    }
}

fn machine(batching: Batching, now: Instant) -> Machine {
    Machine::new(rules(), batching, now)
}

fn delivered(tag: u64) -> Input {
    Input::Delivered { tag: Tag(tag), arrival: Arrival::default(), unreadable: None }
}

fn redelivered(tag: u64) -> Input {
    Input::Delivered { tag: Tag(tag), arrival: Arrival { redelivered: true, ..Arrival::default() }, unreadable: None }
}

fn unreadable(tag: u64) -> Input {
    Input::Delivered { tag: Tag(tag), arrival: Arrival::default(), unreadable: Some("no message_id".into()) }
}

fn applied(tag: u64, applied: Result<Applied, HandlerError>) -> Input {
    Input::Applied { tag: Tag(tag), applied }
}

fn outage() -> HandlerError {
    HandlerError::Unavailable("connection refused".into())
}

fn apply(tag: u64) -> Action {
    Action::Apply(Tag(tag))
}

fn ack(tag: u64) -> Action {
    Action::Settle { tag: Tag(tag), settlement: Settlement::Ack(Applied::Done), ledger: super::LedgerEntry::NotCounted }
}

fn batch(tags: &[u64]) -> Action {
    Action::ApplyBatch(tags.iter().copied().map(Tag).collect())
}

/// Everything the machine asks for at `now`.
fn poll(machine: &mut Machine, now: Instant) -> Vec<Action> {
    std::iter::from_fn(|| machine.poll_action(now)).collect()
}

/// The delivery `tag`, being applied, commits and is acked: it leaves.
fn finish(machine: &mut Machine, now: Instant, tag: u64) {
    machine.handle(now, applied(tag, Ok(Applied::Done)));
    assert_eq!(machine.poll_action(now), Some(ack(tag)));
    machine.handle(now, Input::Settled(Tag(tag)));
}
