//! What the consumer starts next, decided apart from any I/O: a pure state machine over the
//! deliveries received and the work in flight. The session ([`super::session`]) feeds it what
//! happens (a delivery arrived, a task finished, time passed) and does what it answers.
//!
//! Its rules (decisions 0005 and 0008):
//! - without batching, each delivery starts at once, up to the prefetch at a time;
//! - with batching, deliveries gather into the next batch, which starts once nothing is in flight
//!   and it is full, or `max_wait` has passed since it began to gather, or a redelivery is waiting
//!   behind it;
//! - a redelivery (maybe the message that crashed the last process) runs alone: it waits until
//!   nothing else is in flight, and nothing new is accepted until it has finished.

use tokio::time::Instant;

use super::Batching;

/// Work the session is to start.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Start<D> {
    /// One delivery, beside whatever else is in flight (batching off).
    One(D),
    /// A redelivery, with nothing else in flight.
    Alone(D),
    /// A batch, with nothing else in flight.
    Batch(Vec<D>),
}

/// The consumer's scheduling state for one session. `D` is a delivery (any type: the tests use
/// numbers).
#[derive(Debug)]
pub(super) struct Scheduler<D> {
    batching: Batching,
    /// Tasks started and not yet finished: the ones it answered, and the others the session
    /// reported ([`Self::started_other`]).
    in_flight: usize,
    /// A redelivery waiting for everything else to finish.
    waiting: Option<D>,
    /// A redelivery is running alone.
    alone: bool,
    /// Deliveries gathered for the next batch.
    next_batch: Vec<D>,
    /// When the next batch starts even if it is not full.
    next_batch_due: Instant,
}

impl<D> Scheduler<D> {
    pub(super) fn new(batching: Batching, now: Instant) -> Self {
        Self { batching, in_flight: 0, waiting: None, alone: false, next_batch: Vec::new(), next_batch_due: now }
    }

    /// Whether to take the next delivery from the work queue: not while a redelivery waits to run
    /// alone, or runs.
    pub(super) fn accepting(&self) -> bool {
        self.waiting.is_none() && !self.alone
    }

    /// Whether a batch is gathering and has room: the session then takes whatever else is ready at
    /// once, without waiting.
    pub(super) fn wants_more(&self) -> bool {
        self.batching.on()
            && self.waiting.is_none()
            && !self.next_batch.is_empty()
            && self.next_batch.len() < self.batching.max_size
    }

    /// A delivery arrived from the work queue. Without batching, it starts at once.
    pub(super) fn received(&mut self, delivery: D, redelivered: bool, now: Instant) -> Option<Start<D>> {
        debug_assert!(self.accepting(), "a delivery arrived while not accepting");
        if redelivered {
            self.waiting = Some(delivery);
            return None;
        }
        if !self.batching.on() {
            self.in_flight += 1;
            return Some(Start::One(delivery));
        }
        if self.next_batch.is_empty() && self.in_flight == 0 {
            self.next_batch_due = now + self.batching.max_wait;
        }
        self.next_batch.push(delivery);
        None
    }

    /// The session started a task of its own (parking what the broker dead-lettered): a
    /// redelivery waits for it too.
    pub(super) fn started_other(&mut self) {
        self.in_flight += 1;
    }

    /// A task finished (settled, or failed to).
    pub(super) fn finished(&mut self) {
        debug_assert!(self.in_flight > 0, "finished more than started");
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Tasks in flight, as the scheduler counts them.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// What to start now, if anything: the next batch, else a waiting redelivery, and either only
    /// once nothing is in flight.
    pub(super) fn next(&mut self, now: Instant) -> Option<Start<D>> {
        if self.in_flight > 0 {
            return None;
        }
        // Nothing in flight: whatever ran alone has finished.
        self.alone = false;
        if !self.next_batch.is_empty() {
            let full = self.next_batch.len() >= self.batching.max_size;
            if !(full || self.waiting.is_some() || now >= self.next_batch_due) {
                return None;
            }
            let take = self.next_batch.len().min(self.batching.max_size);
            let batch = self.next_batch.drain(..take).collect();
            self.next_batch_due = now + self.batching.max_wait;
            self.in_flight += 1;
            return Some(Start::Batch(batch));
        }
        let redelivery = self.waiting.take()?;
        self.alone = true;
        self.in_flight += 1;
        Some(Start::Alone(redelivery))
    }

    /// When to ask [`Self::next`] again if nothing else happens: when a batch that is not full is
    /// due, if one is gathering with nothing in flight.
    pub(super) fn wake_at(&self) -> Option<Instant> {
        (self.in_flight == 0 && !self.next_batch.is_empty()).then_some(self.next_batch_due)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::{Instant, advance};

    use super::{Scheduler, Start};
    use crate::consumer::Batching;

    const WAIT: Duration = Duration::from_millis(20);

    fn batching(max_size: usize) -> Batching {
        Batching { max_size, max_wait: WAIT }
    }

    #[tokio::test(start_paused = true)]
    async fn without_batching_each_delivery_starts_at_once_beside_the_others() {
        let mut scheduler = Scheduler::new(Batching::OFF, Instant::now());
        assert_eq!(scheduler.received(1, false, Instant::now()), Some(Start::One(1)));
        assert_eq!(scheduler.received(2, false, Instant::now()), Some(Start::One(2)));
        assert_eq!(scheduler.in_flight(), 2);
        assert!(scheduler.accepting());
        assert!(!scheduler.wants_more());
        assert_eq!(scheduler.next(Instant::now()), None);
        assert_eq!(scheduler.wake_at(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_waits_for_everything_in_flight_then_runs_alone() {
        let mut scheduler = Scheduler::new(Batching::OFF, Instant::now());
        assert_eq!(scheduler.received(1, false, Instant::now()), Some(Start::One(1)));
        assert_eq!(scheduler.received(2, true, Instant::now()), None);
        // Nothing more is taken while it waits, and it does not start beside 1.
        assert!(!scheduler.accepting());
        assert_eq!(scheduler.next(Instant::now()), None);

        scheduler.finished();
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Alone(2)));
        // Nor while it runs.
        assert!(!scheduler.accepting());
        assert_eq!(scheduler.next(Instant::now()), None);

        scheduler.finished();
        assert_eq!(scheduler.next(Instant::now()), None);
        assert!(scheduler.accepting());
        assert_eq!(scheduler.received(3, false, Instant::now()), Some(Start::One(3)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_waits_for_a_dead_letter_being_parked() {
        let mut scheduler = Scheduler::new(batching(4), Instant::now());
        scheduler.started_other();
        assert_eq!(scheduler.received(1, true, Instant::now()), None);
        assert_eq!(scheduler.next(Instant::now()), None);
        scheduler.finished();
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Alone(1)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_that_is_not_full_starts_when_its_wait_is_over() {
        let mut scheduler = Scheduler::new(batching(4), Instant::now());
        assert_eq!(scheduler.received(1, false, Instant::now()), None);
        assert!(scheduler.wants_more());
        assert_eq!(scheduler.received(2, false, Instant::now()), None);
        let due = Instant::now() + WAIT;
        assert_eq!(scheduler.wake_at(), Some(due));
        assert_eq!(scheduler.next(Instant::now()), None);

        advance(WAIT - Duration::from_millis(1)).await;
        assert_eq!(scheduler.next(Instant::now()), None);
        advance(Duration::from_millis(1)).await;
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![1, 2])));
        assert_eq!(scheduler.wake_at(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_starts_at_once_and_the_rest_waits_for_it_to_settle() {
        let mut scheduler = Scheduler::new(batching(2), Instant::now());
        scheduler.received(1, false, Instant::now());
        scheduler.received(2, false, Instant::now());
        assert!(!scheduler.wants_more());
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![1, 2])));

        // Deliveries keep arriving while it runs; the next batch starts once it has settled,
        // however long ago they came.
        assert!(scheduler.accepting());
        scheduler.received(3, false, Instant::now());
        advance(WAIT * 10).await;
        assert_eq!(scheduler.wake_at(), None);
        assert_eq!(scheduler.next(Instant::now()), None);
        scheduler.finished();
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![3])));
    }

    #[tokio::test(start_paused = true)]
    async fn gathering_behind_a_running_batch_does_not_restart_the_wait() {
        let mut scheduler = Scheduler::new(batching(3), Instant::now());
        scheduler.received(1, false, Instant::now());
        advance(WAIT).await;
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![1])));
        // The next batch's wait runs from when the last one started, not from its first delivery.
        advance(WAIT / 2).await;
        scheduler.received(2, false, Instant::now());
        scheduler.finished();
        let due = scheduler.wake_at().expect("a batch is gathering");
        assert_eq!(due, Instant::now() + WAIT / 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_behind_a_gathering_batch_lets_the_batch_go_first_without_waiting() {
        let mut scheduler = Scheduler::new(batching(4), Instant::now());
        scheduler.received(1, false, Instant::now());
        assert_eq!(scheduler.received(2, true, Instant::now()), None);
        assert!(!scheduler.wants_more());
        assert!(!scheduler.accepting());
        // Not due, not full: it goes now, since the redelivery waits behind it.
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![1])));
        assert_eq!(scheduler.next(Instant::now()), None);
        scheduler.finished();
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Alone(2)));
    }

    #[tokio::test(start_paused = true)]
    async fn more_than_a_batch_splits_into_full_batches() {
        let mut scheduler = Scheduler::new(batching(2), Instant::now());
        scheduler.started_other();
        for delivery in 1..=5 {
            scheduler.received(delivery, false, Instant::now());
        }
        scheduler.finished();
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![1, 2])));
        scheduler.finished();
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![3, 4])));
        scheduler.finished();
        // The last one is not full: it waits out its time.
        assert_eq!(scheduler.next(Instant::now()), None);
        advance(WAIT).await;
        assert_eq!(scheduler.next(Instant::now()), Some(Start::Batch(vec![5])));
    }
}
