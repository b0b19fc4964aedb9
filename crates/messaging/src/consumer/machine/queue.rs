//! What the consumer starts next: the deliveries received and not yet started, and the work in
//! flight. Its rules (decisions 0005 and 0008):
//! - without batching, each delivery starts at once, up to the prefetch at a time;
//! - with batching, deliveries gather into the next batch, which starts once nothing is in flight
//!   and it is full, or `max_wait` has passed since it began to gather, or a redelivery is waiting
//!   behind it;
//! - a redelivery (maybe the message that crashed the last process) runs alone: it waits until
//!   nothing else is in flight, and nothing new is accepted until it has finished.

use std::time::Instant;

use crate::consumer::Batching;

/// What the queue starts: a slot in flight each.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Next<D> {
    /// One delivery, beside whatever else is in flight (batching off).
    One(D),
    /// A redelivery, with nothing else in flight: it may be the message that crashed the last
    /// process.
    Alone(D),
    /// A batch, with nothing else in flight.
    Batch(Vec<D>),
}

/// The consumer's scheduling state for one session: the slots in flight, and what waits for one.
/// `D` names a delivery.
#[derive(Debug)]
pub(super) struct Queue<D> {
    batching: Batching,
    /// Slots taken and not yet freed: the ones it scheduled, and the others the machine reported
    /// ([`Self::started_other`]).
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

impl<D> Queue<D> {
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
    pub(super) fn received(&mut self, delivery: D, redelivered: bool, now: Instant) -> Option<Next<D>> {
        debug_assert!(self.accepting(), "a delivery arrived while not accepting");
        if redelivered {
            self.waiting = Some(delivery);
            return None;
        }
        if !self.batching.on() {
            self.in_flight += 1;
            return Some(Next::One(delivery));
        }
        if self.next_batch.is_empty() && self.in_flight == 0 {
            self.next_batch_due = now + self.batching.max_wait;
        }
        self.next_batch.push(delivery);
        None
    }

    /// The session started a task of its own (parking what the broker dead-lettered), in a slot: a
    /// redelivery waits for it too.
    pub(super) fn started_other(&mut self) {
        self.in_flight += 1;
    }

    /// A slot is free: what held it has left (settled, or failed to).
    pub(super) fn finished(&mut self) {
        debug_assert!(self.in_flight > 0, "finished more than started");
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Slots in flight.
    pub(super) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// What to start now, if anything: the next batch, else a waiting redelivery, and either only
    /// once nothing is in flight.
    pub(super) fn next(&mut self, now: Instant) -> Option<Next<D>> {
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
            return Some(Next::Batch(batch));
        }
        let redelivery = self.waiting.take()?;
        self.alone = true;
        self.in_flight += 1;
        Some(Next::Alone(redelivery))
    }

    /// When to ask [`Self::next`] again if nothing else happens: when a batch that is not full is
    /// due, if one is gathering with nothing in flight.
    pub(super) fn wake_at(&self) -> Option<Instant> {
        (self.in_flight == 0 && !self.next_batch.is_empty()).then_some(self.next_batch_due)
    }
}
