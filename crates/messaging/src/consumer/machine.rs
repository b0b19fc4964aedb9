//! The consumer's decisions, free of I/O (decision 0035): one [`Machine`] per session decides
//! what to start next and what becomes of each delivery, with the types it reads and answers
//! with, one type per file. Nothing here names lapin, sqlx, tokio or `tracing`: the session
//! performs the machine's actions, feeds back what they came to, and tells the time.

mod action;
mod applied;
mod arrival;
mod attempt;
mod batch;
mod decision;
mod input;
mod ledger_entry;
mod queue;
mod republish;
mod rules;
mod settlement;
mod stage;
mod tag;
#[cfg(test)]
mod tests;
mod tracked;

use std::{
    collections::{BTreeMap, VecDeque},
    time::Instant,
};

pub(super) use action::Action;
pub(super) use applied::Applied;
pub(super) use arrival::Arrival;
pub(super) use attempt::Attempt;
use batch::Batch;
pub(super) use decision::MAX_DEFERRALS;
use decision::{Decision, Event, Step};
pub(super) use input::Input;
pub(super) use ledger_entry::LedgerEntry;
use queue::{Next, Queue};
pub(super) use republish::Republish;
pub(super) use rules::Rules;
pub(super) use settlement::Settlement;
use stage::Stage;
pub(super) use tag::Tag;
use tracked::Tracked;

use super::Batching;

/// One session's consumer, free of I/O, as quinn-proto's `Connection` is: the session feeds it
/// what happened ([`Self::handle`], [`Self::handle_timeout`]) and asks it what to do now
/// ([`Self::poll_action`]) and when to ask again if nothing happens ([`Self::poll_timeout`]). It
/// never sleeps, and it is told the time.
///
/// It keeps, for each delivery from its arrival until it leaves, where it is ([`Stage`]) and its
/// [`Decision`]; the slots in flight and what waits for one ([`Queue`]); and the batch in flight,
/// whose deliveries go one by one, in order, if its transaction fails ([`Batch`]).
#[derive(Debug)]
pub(super) struct Machine {
    rules: Rules,
    queue: Queue<Tag>,
    tracked: BTreeMap<Tag, Tracked>,
    batch: Option<Batch>,
    /// Asked for, not yet polled.
    actions: VecDeque<Action>,
    /// Dead letters being parked, each by a task of its own, in a slot.
    dead_letters: usize,
    /// The session has ended: nothing new starts, and a wait for the database ends at once.
    ended: bool,
}

impl Machine {
    pub(super) fn new(rules: Rules, batching: Batching, now: Instant) -> Self {
        Self {
            rules,
            queue: Queue::new(batching, now),
            tracked: BTreeMap::new(),
            batch: None,
            actions: VecDeque::new(),
            dead_letters: 0,
            ended: false,
        }
    }

    /// `input` happened at `now`.
    pub(super) fn handle(&mut self, now: Instant, input: Input) {
        match input {
            Input::Delivered { tag, arrival, unreadable } => {
                let decision = Decision::new(arrival);
                let stage = Stage::Queued;
                let tracked = Tracked { arrival, unreadable, decision, stage, scheduled: false, own_slot: false };
                self.tracked.insert(tag, tracked);
                if let Some(next) = self.queue.received(tag, arrival.redelivered, now) {
                    self.schedule(next, now);
                }
            }
            Input::DeadLettered => {
                self.dead_letters += 1;
                self.queue.started_other();
            }
            Input::DeadLetterParked => {
                debug_assert!(self.dead_letters > 0, "a dead letter parked that was not being parked");
                self.dead_letters = self.dead_letters.saturating_sub(1);
                self.queue.finished();
            }
            Input::Started { tag, starts } => self.after(tag, now, Event::Started(starts)),
            Input::Applied { tag, applied } => self.after(tag, now, Event::Applied(applied)),
            Input::BatchApplied { committed } => self.batch_applied(committed, now),
            Input::Settled(tag) => {
                let settling = self.tracked.get(&tag).is_some_and(|tracked| tracked.stage == Stage::Settling);
                debug_assert!(settling, "{tag:?} settled, not being settled");
                self.left(tag, now);
            }
            Input::Panicked(tags) => {
                for tag in tags {
                    self.left(tag, now);
                }
            }
            Input::SessionEnded => self.session_ended(now),
        }
        self.check();
    }

    /// Time passed: the waits over by `now` end, and their deliveries are tried again.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        let due: Vec<(Tag, Attempt)> = self
            .tracked
            .iter()
            .filter_map(|(tag, tracked)| match tracked.stage {
                Stage::WaitingOut { until, again } if until <= now => Some((*tag, again)),
                _ => None,
            })
            .collect();
        for (tag, again) in due {
            self.step(tag, now, Step::Try(again));
        }
    }

    /// What to do now, if anything; asked until it answers `None`. A batch is taken here, not
    /// when its last delivery arrives, so that it holds whatever else was ready by then.
    pub(super) fn poll_action(&mut self, now: Instant) -> Option<Action> {
        loop {
            if let Some(action) = self.actions.pop_front() {
                return Some(action);
            }
            if self.ended {
                return None;
            }
            let next = self.queue.next(now)?;
            self.schedule(next, now);
            self.check();
        }
    }

    /// When to call [`Self::handle_timeout`] and poll again if nothing happens before: the end of
    /// the first wait for the database, or when a batch that is not full is due.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        let batch = self.queue.wake_at().filter(|_| !self.ended);
        let waits = self.tracked.values().filter_map(|tracked| match tracked.stage {
            Stage::WaitingOut { until, .. } => Some(until),
            _ => None,
        });
        batch.into_iter().chain(waits).min()
    }

    /// Whether to take the next delivery from the work queue: not once the session has ended,
    /// nor while a redelivery waits to run alone, or runs.
    pub(super) fn accepting(&self) -> bool {
        !self.ended && self.queue.accepting()
    }

    /// Whether a batch is gathering and has room: the session then takes whatever else is ready at
    /// once, without waiting.
    pub(super) fn wants_more(&self) -> bool {
        self.queue.wants_more()
    }

    /// Slots in flight: deliveries started alone, the batch, dead letters being parked.
    pub(super) fn in_flight(&self) -> usize {
        self.queue.in_flight()
    }

    /// Nothing is tracked, in flight or asked for: the session may open its channels again.
    pub(super) fn is_idle(&self) -> bool {
        self.tracked.is_empty() && self.queue.in_flight() == 0 && self.actions.is_empty()
    }

    /// The session has ended and every delivery started has left: nothing more will be asked.
    pub(super) fn is_drained(&self) -> bool {
        self.ended && self.queue.in_flight() == 0 && self.actions.is_empty()
    }

    /// The queue scheduled `next`, taking a slot: each delivery begins its way.
    fn schedule(&mut self, next: Next<Tag>, now: Instant) {
        match next {
            Next::One(tag) | Next::Alone(tag) => match self.tracked.get_mut(&tag) {
                Some(tracked) => {
                    tracked.scheduled = true;
                    tracked.own_slot = true;
                    self.begin(tag, now);
                }
                // Never: the queue holds only tracked deliveries. Its slot is not kept.
                None => self.queue.finished(),
            },
            Next::Batch(tags) => {
                for tag in &tags {
                    if let Some(tracked) = self.tracked.get_mut(tag) {
                        tracked.scheduled = true;
                    }
                }
                self.start_batch(tags, now);
            }
        }
    }

    /// A batch starts: its unreadable deliveries are parked; two readable ones or more are
    /// applied in one transaction, a single one on its own.
    fn start_batch(&mut self, tags: Vec<Tag>, now: Instant) {
        let mut batch = Batch { out: tags.iter().copied().collect(), ..Batch::default() };
        let mut readable = Vec::with_capacity(tags.len());
        for tag in tags {
            match self.tracked.get(&tag) {
                Some(tracked) if tracked.unreadable.is_none() => readable.push(tag),
                Some(_) => {}
                None => {
                    batch.out.remove(&tag);
                }
            }
        }
        let unreadable: Vec<Tag> = batch.out.iter().copied().filter(|tag| !readable.contains(tag)).collect();
        if readable.len() > 1 {
            for tag in &readable {
                self.set_stage(*tag, Stage::InBatch);
            }
            self.actions.push_back(Action::ApplyBatch(readable));
        } else {
            batch.rest.extend(readable);
        }
        self.batch = Some(batch);
        for tag in unreadable {
            self.begin(tag, now);
        }
        self.go_on(now);
        self.batch_done_if_empty();
    }

    /// The batch's transaction ended: committed (its deliveries acked), or not applied, and then
    /// its deliveries go one by one, in order.
    fn batch_applied(&mut self, committed: bool, now: Instant) {
        let Some(batch) = self.batch.as_mut() else { return };
        let applied: Vec<Tag> = batch
            .out
            .iter()
            .copied()
            .filter(|tag| self.tracked.get(tag).is_some_and(|tracked| tracked.stage == Stage::InBatch))
            .collect();
        if committed {
            for tag in applied {
                self.tracked.remove(&tag);
                batch.out.remove(&tag);
            }
            self.batch_done_if_empty();
            return;
        }
        for tag in &applied {
            if let Some(tracked) = self.tracked.get_mut(tag) {
                tracked.stage = Stage::Queued;
            }
        }
        batch.rest.extend(applied);
        self.go_on(now);
    }

    /// In a failed batch, the next delivery goes, once the one before has left.
    fn go_on(&mut self, now: Instant) {
        let Some(batch) = self.batch.as_mut() else { return };
        if batch.going.is_some() {
            return;
        }
        let Some(next) = batch.rest.pop_front() else { return };
        batch.going = Some(next);
        self.begin(next, now);
    }

    /// The batch's last delivery has left: its slot is free.
    fn batch_done_if_empty(&mut self) {
        if self.batch.as_ref().is_some_and(|batch| batch.out.is_empty()) {
            self.batch = None;
            self.queue.finished();
        }
    }

    /// A started delivery begins its way: an unreadable one is parked at once, any other takes
    /// its decision's first step.
    fn begin(&mut self, tag: Tag, now: Instant) {
        let Some(tracked) = self.tracked.get_mut(&tag) else { return };
        let step = match &tracked.unreadable {
            Some(why) => Step::Settle(Decision::unreadable(tracked.arrival, why)),
            None => tracked.decision.first(),
        };
        self.step(tag, now, step);
    }

    /// What happened to a delivery's attempt (or, `SessionEnded`, to its wait): its decision's
    /// next step. An answer for a delivery not trying anything is a bug, and ignored.
    fn after(&mut self, tag: Tag, now: Instant, event: Event) {
        let Some(tracked) = self.tracked.get_mut(&tag) else { return };
        let expected = match event {
            Event::SessionEnded => matches!(tracked.stage, Stage::WaitingOut { .. }),
            Event::Started(_) | Event::Applied(_) => tracked.stage == Stage::Trying,
        };
        debug_assert!(expected, "{event:?} for {tag:?} at {:?}", tracked.stage);
        if !expected {
            return;
        }
        let step = tracked.decision.next(&self.rules, now, event);
        self.step(tag, now, step);
    }

    /// Take `step` for the delivery: an action, or a wait (once the session has ended, a wait is
    /// over at once: the delivery is handed back).
    fn step(&mut self, tag: Tag, now: Instant, step: Step) {
        let Some(tracked) = self.tracked.get_mut(&tag) else { return };
        match step {
            Step::Try(attempt) => {
                tracked.stage = Stage::Trying;
                self.actions.push_back(match attempt {
                    Attempt::CountStart => Action::CountStart(tag),
                    Attempt::Apply => Action::Apply(tag),
                });
            }
            Step::WaitOut { .. } if self.ended => {
                let step = tracked.decision.next(&self.rules, now, Event::SessionEnded);
                self.step(tag, now, step);
            }
            Step::WaitOut { until, again, error } => {
                tracked.stage = Stage::WaitingOut { until, again };
                let delay = until.saturating_duration_since(now);
                self.actions.push_back(Action::Wait { tag, delay, error });
            }
            Step::Settle(settlement) => {
                tracked.stage = Stage::Settling;
                let ledger = tracked.decision.ledger();
                self.actions.push_back(Action::Settle { tag, settlement, ledger });
            }
        }
    }

    /// The delivery has left (settled, or lost with its effect): its slot is free, or its batch
    /// goes on.
    fn left(&mut self, tag: Tag, now: Instant) {
        let Some(tracked) = self.tracked.remove(&tag) else { return };
        debug_assert!(tracked.scheduled, "{tag:?} left before it was scheduled");
        if tracked.own_slot {
            self.queue.finished();
            return;
        }
        let Some(batch) = self.batch.as_mut() else { return };
        batch.out.remove(&tag);
        if batch.going == Some(tag) {
            batch.going = None;
            self.go_on(now);
        }
        self.batch_done_if_empty();
    }

    /// The session ended: what was never started is forgotten (the broker redelivers it), and
    /// every wait for the database ends, handing its delivery back.
    fn session_ended(&mut self, now: Instant) {
        self.ended = true;
        self.tracked.retain(|_, tracked| tracked.scheduled);
        let waiting: Vec<Tag> = self
            .tracked
            .iter()
            .filter(|(_, tracked)| matches!(tracked.stage, Stage::WaitingOut { .. }))
            .map(|(tag, _)| *tag)
            .collect();
        for tag in waiting {
            self.after(tag, now, Event::SessionEnded);
        }
    }

    fn set_stage(&mut self, tag: Tag, stage: Stage) {
        if let Some(tracked) = self.tracked.get_mut(&tag) {
            tracked.stage = stage;
        }
    }

    /// In a debug build, the slots the queue counts are the ones held: each delivery of its own,
    /// the batch, each dead letter being parked.
    fn check(&self) {
        if cfg!(debug_assertions) {
            let own = self.tracked.values().filter(|tracked| tracked.own_slot).count();
            let held = own + usize::from(self.batch.is_some()) + self.dead_letters;
            debug_assert_eq!(self.queue.in_flight(), held, "slots counted against slots held");
        }
    }
}
