//! Waits for the database, the session's end, and effects that panic.

use std::time::{Duration, Instant};

use super::{Action, Applied, Input, Settlement, Tag, ack, applied, apply, delivered, machine, outage, poll};
use crate::consumer::{Batching, machine::LedgerEntry};

#[test]
fn an_outage_is_waited_out_with_backoff_and_the_same_step_tried_again() {
    let t0 = Instant::now();
    let mut machine = machine(Batching::OFF, t0);
    machine.handle(t0, delivered(1));
    assert_eq!(poll(&mut machine, t0), [apply(1)]);
    let mut now = t0;
    for wait in [100, 200, 400] {
        machine.handle(now, applied(1, Err(outage())));
        let actions = poll(&mut machine, now);
        let delay = Duration::from_millis(wait);
        assert!(matches!(actions[..], [Action::Wait { tag: Tag(1), delay: d, .. }] if d == delay), "{actions:?}");
        assert_eq!(machine.poll_timeout(), Some(now + delay));
        // Not before its time.
        machine.handle_timeout(now + delay - Duration::from_millis(1));
        assert_eq!(poll(&mut machine, now), []);
        now += delay;
        machine.handle_timeout(now);
        assert_eq!(poll(&mut machine, now), [apply(1)]);
    }
    machine.handle(now, applied(1, Ok(Applied::Done)));
    assert_eq!(poll(&mut machine, now), [ack(1)]);
    assert_eq!(now - t0, Duration::from_millis(700));
}

#[test]
fn a_session_that_ends_during_a_wait_hands_the_delivery_back_at_once_and_drains() {
    let t0 = Instant::now();
    let mut machine = machine(Batching::OFF, t0);
    machine.handle(t0, delivered(1));
    machine.handle(t0, delivered(2));
    assert_eq!(poll(&mut machine, t0), [apply(1), apply(2)]);
    machine.handle(t0, applied(1, Err(outage())));
    let _wait = poll(&mut machine, t0);

    let ended = t0 + Duration::from_millis(30);
    machine.handle(ended, Input::SessionEnded);
    let hand_back = Action::Settle { tag: Tag(1), settlement: Settlement::HandBack, ledger: LedgerEntry::NotCounted };
    assert_eq!(poll(&mut machine, ended), [hand_back]);
    assert!(!machine.accepting());
    assert_eq!(machine.poll_timeout(), None);
    // 2's transaction still ends and settles.
    machine.handle(ended, applied(2, Ok(Applied::Done)));
    assert_eq!(poll(&mut machine, ended), [ack(2)]);
    machine.handle(ended, Input::Settled(Tag(1)));
    assert!(!machine.is_drained());
    machine.handle(ended, Input::Settled(Tag(2)));
    assert!(machine.is_drained());
}

#[test]
fn what_was_never_started_is_forgotten_when_the_session_ends() {
    let t0 = Instant::now();
    let mut machine = machine(Batching { max_size: 4, max_wait: Duration::from_millis(20) }, t0);
    machine.handle(t0, delivered(1));
    machine.handle(t0, Input::SessionEnded);
    assert!(machine.is_drained());
    assert_eq!(poll(&mut machine, t0 + Duration::from_secs(1)), []);
}

#[test]
fn an_effect_that_panicked_frees_its_slot_and_nothing_more_is_asked_of_its_delivery() {
    let t0 = Instant::now();
    let mut machine = machine(Batching::OFF, t0);
    machine.handle(t0, delivered(1));
    assert_eq!(poll(&mut machine, t0), [apply(1)]);
    machine.handle(t0, Input::Panicked(vec![Tag(1)]));
    assert_eq!(machine.in_flight(), 0);
    machine.handle(t0, applied(1, Ok(Applied::Done)));
    assert_eq!(poll(&mut machine, t0), []);
}

#[test]
fn a_redelivery_that_crashed_too_often_is_parked_and_keeps_its_count_until_acked() {
    let t0 = Instant::now();
    let mut machine = machine(Batching::OFF, t0);
    machine.handle(t0, super::redelivered(1));
    assert_eq!(poll(&mut machine, t0), [Action::CountStart(Tag(1))]);
    machine.handle(t0, Input::Started { tag: Tag(1), starts: Ok(3) });
    let actions = poll(&mut machine, t0);
    assert!(
        matches!(
            &actions[..],
            [Action::Settle { ledger: LedgerEntry::ForgetOnceParked, settlement: Settlement::Republish(_), .. }]
        ),
        "{actions:?}"
    );
}
