//! A batch: its unreadable deliveries parked, the rest in one transaction; if that fails, each
//! applied on its own, in order, one after the other, in the batch's slot (decision 0008).

use std::time::{Duration, Instant};

use messaging_core::handler::HandlerError;

use super::{
    Action, Applied, Input, Machine, Settlement, Tag, ack, applied, apply, batch, delivered, machine, outage, poll,
    unreadable,
};
use crate::consumer::{
    Batching,
    machine::{LedgerEntry, Republish},
};

fn batching() -> Batching {
    Batching { max_size: 4, max_wait: Duration::from_millis(20) }
}

fn parked(tag: u64, reason: &str) -> Action {
    let settlement = Settlement::Republish(Republish::Park { reason: reason.into(), retry_count: 0 });
    Action::Settle { tag: Tag(tag), settlement, ledger: LedgerEntry::NotCounted }
}

/// Deliveries 1, 2 and 3 gathered into one batch, taken when it is due: the machine, and when.
fn batch_of_three() -> (Machine, Instant) {
    let t0 = Instant::now();
    let mut machine = machine(batching(), t0);
    for tag in 1..=3 {
        machine.handle(t0, delivered(tag));
    }
    let due = machine.poll_timeout().expect("a batch gathers");
    assert_eq!(poll(&mut machine, due), [batch(&[1, 2, 3])]);
    (machine, due)
}

#[test]
fn an_unreadable_delivery_is_parked_and_the_others_applied_together() {
    let t0 = Instant::now();
    let mut machine = machine(batching(), t0);
    for input in [delivered(1), unreadable(2), delivered(3)] {
        machine.handle(t0, input);
    }
    let due = machine.poll_timeout().expect("a batch gathers");
    assert_eq!(poll(&mut machine, due), [batch(&[1, 3]), parked(2, "no message_id")]);
    machine.handle(due, Input::BatchApplied { committed: true });
    // Its slot waits for the parked one too.
    assert_eq!(machine.in_flight(), 1);
    machine.handle(due, Input::Settled(Tag(2)));
    assert_eq!(machine.in_flight(), 0);
}

#[test]
fn a_batch_that_fails_applies_each_delivery_alone_in_order_each_after_the_last_has_left() {
    let (mut machine, due) = batch_of_three();
    machine.handle(due, delivered(4));
    machine.handle(due, Input::BatchApplied { committed: false });
    assert_eq!(poll(&mut machine, due), [apply(1)]);

    machine.handle(due, applied(1, Ok(Applied::Done)));
    assert_eq!(poll(&mut machine, due), [ack(1)], "2 waits for 1 to leave");
    machine.handle(due, Input::Settled(Tag(1)));
    assert_eq!(poll(&mut machine, due), [apply(2)]);

    // A permanent failure: parked, then the next.
    machine.handle(due, applied(2, Err(HandlerError::Permanent("no price for SKU-9".into()))));
    assert_eq!(poll(&mut machine, due), [parked(2, "no price for SKU-9")]);
    machine.handle(due, Input::Settled(Tag(2)));
    assert_eq!(poll(&mut machine, due), [apply(3)]);
    machine.handle(due, applied(3, Ok(Applied::Duplicate)));
    let settle = Action::Settle {
        tag: Tag(3),
        settlement: Settlement::Ack(Applied::Duplicate),
        ledger: LedgerEntry::NotCounted,
    };
    assert_eq!(poll(&mut machine, due), [settle]);
    // No next batch before the last of this one has left.
    let later = due + Duration::from_secs(1);
    assert_eq!(poll(&mut machine, later), []);
    machine.handle(later, Input::Settled(Tag(3)));
    assert_eq!(poll(&mut machine, later), [apply(4)]);
}

#[test]
fn a_session_that_ends_during_a_fallback_hands_back_the_waiting_delivery_and_tries_each_other_once() {
    let (mut machine, due) = batch_of_three();
    machine.handle(due, Input::BatchApplied { committed: false });
    assert_eq!(poll(&mut machine, due), [apply(1)]);
    machine.handle(due, applied(1, Err(outage())));
    let actions = poll(&mut machine, due);
    assert!(matches!(actions[..], [Action::Wait { tag: Tag(1), .. }]), "{actions:?}");

    machine.handle(due, Input::SessionEnded);
    let hand_back =
        |tag| Action::Settle { tag: Tag(tag), settlement: Settlement::HandBack, ledger: LedgerEntry::NotCounted };
    assert_eq!(poll(&mut machine, due), [hand_back(1)]);
    machine.handle(due, Input::Settled(Tag(1)));
    // The next is still tried once, and an outage hands it back at once.
    assert_eq!(poll(&mut machine, due), [apply(2)]);
    machine.handle(due, applied(2, Err(outage())));
    assert_eq!(poll(&mut machine, due), [hand_back(2)]);
    machine.handle(due, Input::Settled(Tag(2)));
    assert_eq!(poll(&mut machine, due), [apply(3)]);
    machine.handle(due, applied(3, Ok(Applied::Done)));
    assert_eq!(poll(&mut machine, due), [ack(3)]);
    assert!(!machine.is_drained());
    machine.handle(due, Input::Settled(Tag(3)));
    assert!(machine.is_drained());
}
