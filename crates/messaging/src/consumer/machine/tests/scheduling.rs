//! What starts when: one at a time or beside others, a redelivery alone, a dead letter being
//! parked, batches gathering.

use std::time::{Duration, Instant};

use super::{Action, Applied, Input, Tag, apply, batch, delivered, finish, machine, poll, redelivered};
use crate::consumer::Batching;

const WAIT: Duration = Duration::from_millis(20);

fn batching(max_size: usize) -> Batching {
    Batching { max_size, max_wait: WAIT }
}

#[test]
fn without_batching_each_delivery_starts_at_once_beside_the_others() {
    let t0 = Instant::now();
    let mut machine = machine(Batching::OFF, t0);
    machine.handle(t0, delivered(1));
    machine.handle(t0, delivered(2));
    assert_eq!(poll(&mut machine, t0), [apply(1), apply(2)]);
    assert_eq!(machine.in_flight(), 2);
    assert!(machine.accepting());
    assert!(!machine.wants_more());
    assert_eq!(machine.poll_timeout(), None);
}

#[test]
fn a_redelivery_waits_for_everything_in_flight_then_runs_alone_its_start_counted_first() {
    let t0 = Instant::now();
    let mut machine = machine(Batching::OFF, t0);
    machine.handle(t0, delivered(1));
    machine.handle(t0, redelivered(2));
    assert_eq!(poll(&mut machine, t0), [apply(1)]);
    // Nothing more is taken while it waits, and it does not start beside 1.
    assert!(!machine.accepting());

    finish(&mut machine, t0, 1);
    assert_eq!(poll(&mut machine, t0), [Action::CountStart(Tag(2))]);
    // Nor while it runs.
    assert!(!machine.accepting());
    machine.handle(t0, Input::Started { tag: Tag(2), starts: Ok(1) });
    assert_eq!(poll(&mut machine, t0), [apply(2)]);
    machine.handle(t0, super::applied(2, Ok(Applied::Done)));
    let settle = poll(&mut machine, t0);
    assert!(matches!(settle[..], [Action::Settle { tag: Tag(2), .. }]), "{settle:?}");
    assert!(!machine.accepting());

    machine.handle(t0, Input::Settled(Tag(2)));
    assert_eq!(poll(&mut machine, t0), []);
    assert!(machine.accepting());
    machine.handle(t0, delivered(3));
    assert_eq!(poll(&mut machine, t0), [apply(3)]);
}

#[test]
fn a_redelivery_waits_for_a_dead_letter_being_parked() {
    let t0 = Instant::now();
    let mut machine = machine(batching(4), t0);
    machine.handle(t0, Input::DeadLettered);
    machine.handle(t0, redelivered(1));
    assert_eq!(poll(&mut machine, t0), []);
    machine.handle(t0, Input::DeadLetterParked);
    assert_eq!(poll(&mut machine, t0), [Action::CountStart(Tag(1))]);
}

#[test]
fn a_batch_that_is_not_full_starts_when_its_wait_is_over() {
    let t0 = Instant::now();
    let mut machine = machine(batching(4), t0);
    machine.handle(t0, delivered(1));
    assert!(machine.wants_more());
    machine.handle(t0, delivered(2));
    assert_eq!(machine.poll_timeout(), Some(t0 + WAIT));
    assert_eq!(poll(&mut machine, t0), []);

    assert_eq!(poll(&mut machine, t0 + WAIT - Duration::from_millis(1)), []);
    assert_eq!(poll(&mut machine, t0 + WAIT), [batch(&[1, 2])]);
    assert_eq!(machine.poll_timeout(), None);
}

#[test]
fn a_batch_takes_what_arrived_before_it_is_polled() {
    let t0 = Instant::now();
    let mut machine = machine(batching(4), t0);
    machine.handle(t0, delivered(1));
    // Past its wait, two more arrive before the session asks.
    machine.handle(t0 + WAIT * 2, delivered(2));
    machine.handle(t0 + WAIT * 2, delivered(3));
    assert_eq!(poll(&mut machine, t0 + WAIT * 2), [batch(&[1, 2, 3])]);
}

#[test]
fn a_full_batch_starts_at_once_and_the_rest_waits_for_it_to_settle() {
    let t0 = Instant::now();
    let mut machine = machine(batching(2), t0);
    machine.handle(t0, delivered(1));
    machine.handle(t0, delivered(2));
    assert!(!machine.wants_more());
    assert_eq!(poll(&mut machine, t0), [batch(&[1, 2])]);

    // Deliveries keep arriving while it runs; the next batch starts once it has settled, however
    // long ago they came.
    assert!(machine.accepting());
    machine.handle(t0, delivered(3));
    let later = t0 + WAIT * 10;
    assert_eq!(machine.poll_timeout(), None);
    assert_eq!(poll(&mut machine, later), []);
    machine.handle(later, Input::BatchApplied { committed: true });
    // A batch of one is applied on its own.
    assert_eq!(poll(&mut machine, later), [apply(3)]);
}

#[test]
fn gathering_behind_a_running_batch_does_not_restart_the_wait() {
    let t0 = Instant::now();
    let mut machine = machine(batching(3), t0);
    machine.handle(t0, delivered(1));
    assert_eq!(poll(&mut machine, t0 + WAIT), [apply(1)]);
    // The next batch's wait runs from when the last one started, not from its first delivery.
    let now = t0 + WAIT + WAIT / 2;
    machine.handle(now, delivered(2));
    finish(&mut machine, now, 1);
    assert_eq!(machine.poll_timeout(), Some(t0 + WAIT * 2));
}

#[test]
fn a_redelivery_behind_a_gathering_batch_lets_the_batch_go_first_without_waiting() {
    let t0 = Instant::now();
    let mut machine = machine(batching(4), t0);
    machine.handle(t0, delivered(1));
    machine.handle(t0, redelivered(2));
    assert!(!machine.wants_more());
    assert!(!machine.accepting());
    // Not due, not full: it goes now, since the redelivery waits behind it.
    assert_eq!(poll(&mut machine, t0), [apply(1)]);
    machine.handle(t0, super::applied(1, Ok(Applied::Done)));
    assert_eq!(poll(&mut machine, t0), [super::ack(1)]);
    machine.handle(t0, Input::Settled(Tag(1)));
    assert_eq!(poll(&mut machine, t0), [Action::CountStart(Tag(2))]);
}

#[test]
fn more_than_a_batch_splits_into_full_batches() {
    let t0 = Instant::now();
    let mut machine = machine(batching(2), t0);
    machine.handle(t0, Input::DeadLettered);
    for tag in 1..=5 {
        machine.handle(t0, delivered(tag));
    }
    machine.handle(t0, Input::DeadLetterParked);
    assert_eq!(poll(&mut machine, t0), [batch(&[1, 2])]);
    machine.handle(t0, Input::BatchApplied { committed: true });
    assert_eq!(poll(&mut machine, t0), [batch(&[3, 4])]);
    machine.handle(t0, Input::BatchApplied { committed: true });
    // The last one is not full: it waits out its time.
    assert_eq!(poll(&mut machine, t0), []);
    assert_eq!(poll(&mut machine, t0 + WAIT), [apply(5)]);
}

#[test]
fn idle_only_with_nothing_gathered_tracked_or_in_flight() {
    let t0 = Instant::now();
    let mut machine = machine(batching(4), t0);
    assert!(machine.is_idle());
    // Gathering, not started: not idle.
    machine.handle(t0, delivered(1));
    assert!(!machine.is_idle());
    // A batch of one is applied alone.
    assert_eq!(poll(&mut machine, t0 + WAIT), [apply(1)]);
    assert!(!machine.is_idle());
    finish(&mut machine, t0 + WAIT, 1);
    assert!(machine.is_idle());
    // A dead letter being parked holds a slot.
    machine.handle(t0 + WAIT, Input::DeadLettered);
    assert!(!machine.is_idle());
    machine.handle(t0 + WAIT, Input::DeadLetterParked);
    assert!(machine.is_idle());
}
