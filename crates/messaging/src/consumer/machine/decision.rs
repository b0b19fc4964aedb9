//! What becomes of one delivery. [`Decision`] is fed what happened (its start was counted, its
//! transaction ended, the session ended) with the time, and answers with the next [`Step`]: try
//! something on the database, wait out an outage until a given instant, or settle. The
//! [`Machine`](super::Machine) keeps one per delivery it tracks and turns its steps into actions;
//! the whole table below is tested here with plain instants.
//!
//! | what happened | what is done |
//! |---|---|
//! | unreadable (no id, an unknown type or major version) | park, with why |
//! | a first delivery | apply it |
//! | a redelivery | count its start in the crash ledger (committed), then apply it |
//! | … started more than `max_crashes` times | park: it keeps killing its consumer |
//! | … once it leaves this process alive, whichever way | forget its start (a crash park: once acked) |
//! | … the crash ledger fails (not an outage) | apply it; the broker's delivery limit stays the net |
//! | applied, or skipped by the inbox as a duplicate | ack |
//! | waits for an earlier message of its key | defer it to the first wait tier, spending no attempt |
//! | … deferred [`MAX_DEFERRALS`] times already | park, naming the place its key is stuck at |
//! | a transient failure, attempts left | retry in the next wait tier |
//! | a transient failure on the last attempt | park: gave up |
//! | a permanent failure | park, with the handler's reason |
//! | the database unreachable (or refusing writes) | wait with backoff and try the same step again, spending nothing |
//! | the session ends during such a wait | hand the delivery back unacked: the broker redelivers it |
//!
//! Retry, park and defer publish a copy before the ack ([`Settlement::Republish`]): the session
//! holds them beside its other work, so that a broker blocking publishers holds only these.

use std::time::Instant;

use messaging_core::handler::{HandlerError, Reason};

use super::{Applied, Arrival, Attempt, LedgerEntry, Republish, Rules, Settlement};

/// Deferrals a message may take before it is parked: a generous bound on a wait that only a bug
/// could make endless (an earlier message that never comes).
pub(in crate::consumer) const MAX_DEFERRALS: u32 = 10_000;

/// What an [`Attempt`] came to, or the session's end.
#[derive(Debug)]
pub(super) enum Event {
    /// The crash ledger's count of starts, this one included.
    Started(Result<u32, HandlerError>),
    /// The transaction's outcome.
    Applied(Result<Applied, HandlerError>),
    /// The session ended (shutdown, or its connection lost) while the delivery waited.
    SessionEnded,
}

/// The next thing to do with a delivery.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step {
    /// Try this.
    Try(Attempt),
    /// The database is unreachable: wait until `until`, unless the session ends first, then try
    /// `again`.
    WaitOut {
        /// The end of the wait, from the reconnect backoff.
        until: Instant,
        /// What is tried after it.
        again: Attempt,
        /// What the database answered.
        error: Reason,
    },
    /// Done deciding.
    Settle(Settlement),
}

/// One delivery's way through the table of this module.
#[derive(Debug, Clone)]
pub(super) struct Decision {
    arrival: Arrival,
    /// Unanswered tries in a row (the backoff's exponent).
    outages: u32,
    /// What becomes of its start in the crash ledger once it leaves.
    start: LedgerEntry,
}

impl Decision {
    /// A delivery that could not be read is parked at once.
    pub(super) fn unreadable(arrival: Arrival, why: &impl std::fmt::Display) -> Settlement {
        Settlement::Republish(Republish::Park { reason: why.to_string(), retry_count: arrival.retry_count })
    }

    /// A readable delivery arrived.
    pub(super) fn new(arrival: Arrival) -> Self {
        Self { arrival, outages: 0, start: LedgerEntry::NotCounted }
    }

    /// Its first step: a redelivery's start is counted first.
    pub(super) fn first(&self) -> Step {
        Step::Try(if self.arrival.redelivered { Attempt::CountStart } else { Attempt::Apply })
    }

    /// What becomes of its start in the crash ledger once it leaves ([`LedgerEntry`]).
    pub(super) fn ledger(&self) -> LedgerEntry {
        self.start
    }

    /// The step after `event`, which happened at `now`, under `rules`.
    pub(super) fn next(&mut self, rules: &Rules, now: Instant, event: Event) -> Step {
        let again = match &event {
            Event::Started(_) => Attempt::CountStart,
            Event::Applied(_) => Attempt::Apply,
            Event::SessionEnded => return Step::Settle(Settlement::HandBack),
        };
        match event {
            Event::Started(Err(HandlerError::Unavailable(error)))
            | Event::Applied(Err(HandlerError::Unavailable(error))) => {
                let delay = rules.reconnect.delay_drawn(self.outages, (rules.draw)());
                self.outages = self.outages.saturating_add(1);
                return Step::WaitOut { until: now + delay, again, error };
            }
            _ => self.outages = 0,
        }
        match event {
            Event::Started(Ok(starts)) => {
                self.start = LedgerEntry::Forget;
                if starts > rules.max_crashes {
                    self.start = LedgerEntry::ForgetOnceParked;
                    let crashes = starts - 1;
                    return self.park(format!(
                        "crashed its consumer {crashes} times: handled alone, it never finished (process killed, \
                         panicked or hung); not handled again"
                    ));
                }
                Step::Try(Attempt::Apply)
            }
            // The ledger itself fails (not an outage): handle the message; the broker's delivery
            // limit remains the crash net. The start may have been counted all the same (its
            // answer lost): it is forgotten too, which is harmless if it was not.
            Event::Started(Err(_)) => {
                self.start = LedgerEntry::Forget;
                Step::Try(Attempt::Apply)
            }
            Event::Applied(Ok(Applied::Waits { follows })) => self.defer(rules, follows),
            Event::Applied(Ok(applied)) => Step::Settle(Settlement::Ack(applied)),
            Event::Applied(Err(HandlerError::Transient(error) | HandlerError::Unavailable(error))) => {
                let retry_count = self.arrival.retry_count;
                match rules.policy.next_delay(retry_count) {
                    Some(delay) => {
                        let error = error.text().to_owned();
                        Step::Settle(Settlement::Republish(Republish::Retry { delay, error, retry_count }))
                    }
                    None => self.park(format!("gave up after {} attempts: {error}", retry_count.saturating_add(1))),
                }
            }
            Event::Applied(Err(HandlerError::Permanent(error))) => self.park(error.text().to_owned()),
            Event::SessionEnded => Step::Settle(Settlement::HandBack),
        }
    }

    fn park(&self, reason: String) -> Step {
        Step::Settle(Settlement::Republish(Republish::Park { reason, retry_count: self.arrival.retry_count }))
    }

    /// Back to the first wait tier behind place `follows`, or parked after [`MAX_DEFERRALS`].
    fn defer(&self, rules: &Rules, follows: i64) -> Step {
        let deferrals = self.arrival.deferrals.saturating_add(1);
        match rules.policy.delays().first().filter(|_| deferrals <= MAX_DEFERRALS) {
            Some(&delay) => Step::Settle(Settlement::Republish(Republish::Defer { follows, delay, deferrals })),
            None => {
                let place = self.arrival.place.unwrap_or(0);
                self.park(format!("waited {MAX_DEFERRALS} times for place {follows} of its key (it is place {place})"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::VecDeque,
        time::{Duration, Instant},
    };

    use super::{
        Applied, Arrival, Attempt, Decision, Event, HandlerError, LedgerEntry, MAX_DEFERRALS, Republish, Rules,
        Settlement, Step,
    };
    use crate::{runtime::backoff::Backoff, topology::RetryPolicy};

    const TIER: Duration = Duration::from_secs(5);

    /// Backoffs drawn at the top of their range: the waits are exactly 100, 200, 400 ms.
    fn rules() -> Rules {
        Rules {
            policy: RetryPolicy::new(vec![TIER, Duration::from_secs(30)], 3),
            max_crashes: 2,
            reconnect: Backoff::new(Duration::from_millis(100), Duration::from_secs(10)),
            draw: || 1.0,
        }
    }

    fn transient() -> HandlerError {
        HandlerError::Transient("deadlock".into())
    }

    fn permanent() -> HandlerError {
        HandlerError::Permanent("no price for SKU-9".into())
    }

    fn outage() -> HandlerError {
        HandlerError::Unavailable("connection refused".into())
    }

    /// What a delivery came to: its settlement, what was attempted and when (from its arrival),
    /// when it settled, and whether its start is to be forgotten.
    #[derive(Debug)]
    struct Run {
        settlement: Settlement,
        attempts: Vec<(Attempt, Duration)>,
        took: Duration,
        start: LedgerEntry,
    }

    /// Walk a delivery that arrived as `arrival` through `events`, answered in order to its
    /// attempts, as its task does: each wait lasts until the instant its step names, unless the
    /// session ends first, `session_ends` after the arrival.
    fn run(arrival: Arrival, events: Vec<Event>, session_ends: Option<Duration>) -> Run {
        let rules = rules();
        let arrived = Instant::now();
        let ends = session_ends.map(|after| arrived + after);
        let mut events = VecDeque::from(events);
        let (mut now, mut attempts) = (arrived, Vec::new());
        let mut decision = Decision::new(arrival);
        let mut step = decision.first();
        let settlement = loop {
            step = match step {
                Step::Settle(settlement) => break settlement,
                Step::Try(attempt) => {
                    attempts.push((attempt, now - arrived));
                    decision.next(&rules, now, events.pop_front().expect("an outcome for every attempt"))
                }
                Step::WaitOut { until, again, .. } => match ends {
                    Some(end) if end <= until => {
                        now = end;
                        decision.next(&rules, now, Event::SessionEnded)
                    }
                    _ => {
                        now = until;
                        Step::Try(again)
                    }
                },
            };
        };
        if session_ends.is_none() {
            assert!(events.is_empty(), "every scripted outcome is used");
        }
        Run { settlement, attempts, took: now - arrived, start: decision.ledger() }
    }

    fn first() -> Arrival {
        Arrival::default()
    }

    fn tried(run: &Run) -> Vec<Attempt> {
        run.attempts.iter().map(|(attempt, _)| *attempt).collect()
    }

    #[test]
    fn an_applied_delivery_or_a_duplicate_is_acked_at_once() {
        for applied in [Applied::Done, Applied::Duplicate] {
            let run = run(first(), vec![Event::Applied(Ok(applied))], None);
            assert_eq!(run.settlement, Settlement::Ack(applied));
            assert_eq!(run.attempts, [(Attempt::Apply, Duration::ZERO)]);
            assert_eq!((run.took, run.start), (Duration::ZERO, LedgerEntry::NotCounted));
        }
    }

    #[test]
    fn a_transient_failure_is_retried_in_its_tier_until_the_last_attempt_which_parks() {
        let run1 = run(first(), vec![Event::Applied(Err(transient()))], None);
        assert_eq!(
            run1.settlement,
            Settlement::Republish(Republish::Retry { delay: TIER, error: "deadlock".into(), retry_count: 0 })
        );

        let second = Arrival { retry_count: 1, ..first() };
        let run2 = run(second, vec![Event::Applied(Err(transient()))], None);
        assert_eq!(
            run2.settlement,
            Settlement::Republish(Republish::Retry {
                delay: Duration::from_secs(30),
                error: "deadlock".into(),
                retry_count: 1
            })
        );

        let last = Arrival { retry_count: 2, ..first() };
        let run3 = run(last, vec![Event::Applied(Err(transient()))], None);
        assert_eq!(
            run3.settlement,
            Settlement::Republish(Republish::Park {
                reason: "gave up after 3 attempts: deadlock".into(),
                retry_count: 2
            })
        );
    }

    #[test]
    fn a_permanent_failure_is_parked_with_its_reason_on_any_attempt() {
        let run = run(first(), vec![Event::Applied(Err(permanent()))], None);
        assert_eq!(
            run.settlement,
            Settlement::Republish(Republish::Park { reason: "no price for SKU-9".into(), retry_count: 0 })
        );
    }

    #[test]
    fn an_unreadable_delivery_is_parked_with_why() {
        let arrival = Arrival { retry_count: 1, ..first() };
        let settlement = Decision::unreadable(arrival, &"unknown message type: user.deleted");
        assert_eq!(
            settlement,
            Settlement::Republish(Republish::Park {
                reason: "unknown message type: user.deleted".into(),
                retry_count: 1
            })
        );
    }

    #[test]
    fn an_outage_is_waited_out_with_backoff_spending_no_attempt() {
        let events = vec![
            Event::Applied(Err(outage())),
            Event::Applied(Err(outage())),
            Event::Applied(Err(outage())),
            Event::Applied(Err(transient())),
        ];
        let run = run(first(), events, None);
        // The retry is the first one: the outage spent nothing.
        assert_eq!(
            run.settlement,
            Settlement::Republish(Republish::Retry { delay: TIER, error: "deadlock".into(), retry_count: 0 })
        );
        // Waits of 100, 200 and 400 ms (the draw is at the top of each range).
        let at: Vec<u128> = run.attempts.iter().map(|(_, at)| at.as_millis()).collect();
        assert_eq!(at, [0, 100, 300, 700]);
        assert_eq!(run.took, Duration::from_millis(700));
    }

    #[test]
    fn a_wait_is_drawn_from_the_upper_half_of_its_backoff() {
        let rules = Rules { draw: || 0.0, ..rules() };
        let now = Instant::now();
        let mut decision = Decision::new(first());
        let waits: Vec<Duration> = (0..3)
            .map(|_| match decision.next(&rules, now, Event::Applied(Err(outage()))) {
                Step::WaitOut { until, .. } => until - now,
                step => panic!("not a wait: {step:?}"),
            })
            .collect();
        assert_eq!(waits, [50, 100, 200].map(Duration::from_millis));
    }

    #[test]
    fn an_outage_that_outlasts_the_session_hands_the_delivery_back() {
        let events = (0..20).map(|_| Event::Applied(Err(outage()))).collect();
        let ends = Duration::from_secs(3);
        let run = run(first(), events, Some(ends));
        assert_eq!(run.settlement, Settlement::HandBack);
        // Handed back when the session ended, not at the end of a wait.
        assert_eq!(run.took, ends);
        assert!(run.attempts.len() < 20);
    }

    #[test]
    fn a_redelivery_counts_its_start_first_and_is_parked_once_it_has_crashed_too_often() {
        let redelivered = Arrival { redelivered: true, ..first() };
        let done = run(redelivered, vec![Event::Started(Ok(2)), Event::Applied(Ok(Applied::Done))], None);
        assert_eq!(done.settlement, Settlement::Ack(Applied::Done));
        assert_eq!(tried(&done), [Attempt::CountStart, Attempt::Apply]);
        assert_eq!(done.start, LedgerEntry::Forget, "a start that did not crash is forgotten");

        let parked = run(redelivered, vec![Event::Started(Ok(3))], None);
        let reason = "crashed its consumer 2 times: handled alone, it never finished (process killed, panicked or \
                      hung); not handled again";
        assert_eq!(parked.settlement, Settlement::Republish(Republish::Park { reason: reason.into(), retry_count: 0 }));
        assert_eq!(parked.attempts.len(), 1, "not applied again");
        assert_eq!(parked.start, LedgerEntry::ForgetOnceParked, "its count stays until it is parked");
    }

    #[test]
    fn a_crash_ledger_that_fails_or_is_unreachable_does_not_keep_a_redelivery_from_its_handler() {
        let redelivered = Arrival { redelivered: true, ..first() };
        let failed = run(redelivered, vec![Event::Started(Err(permanent())), Event::Applied(Ok(Applied::Done))], None);
        assert_eq!((failed.settlement, failed.start), (Settlement::Ack(Applied::Done), LedgerEntry::Forget));

        // Unreachable: counted once it answers, then applied.
        let events = vec![Event::Started(Err(outage())), Event::Started(Ok(1)), Event::Applied(Ok(Applied::Done))];
        let unreachable = run(redelivered, events, None);
        assert_eq!(tried(&unreachable), [Attempt::CountStart, Attempt::CountStart, Attempt::Apply]);
        assert_eq!((unreachable.settlement, unreachable.start), (Settlement::Ack(Applied::Done), LedgerEntry::Forget));

        // The session ends before the ledger answers: handed back, nothing to forget.
        let events = (0..10).map(|_| Event::Started(Err(outage()))).collect();
        let ended = run(redelivered, events, Some(Duration::from_millis(250)));
        assert_eq!(
            (ended.settlement, ended.took, ended.start),
            (Settlement::HandBack, Duration::from_millis(250), LedgerEntry::NotCounted)
        );
    }

    #[test]
    fn a_message_that_waits_for_its_key_is_deferred_without_spending_an_attempt_then_parked_at_the_bound() {
        let waiting = Arrival { retry_count: 1, deferrals: 4, place: Some(7), ..first() };
        let deferred = run(waiting, vec![Event::Applied(Ok(Applied::Waits { follows: 6 }))], None);
        assert_eq!(
            deferred.settlement,
            Settlement::Republish(Republish::Defer { follows: 6, delay: TIER, deferrals: 5 })
        );

        let worn = Arrival { deferrals: MAX_DEFERRALS, ..waiting };
        let parked = run(worn, vec![Event::Applied(Ok(Applied::Waits { follows: 6 }))], None);
        let reason = format!("waited {MAX_DEFERRALS} times for place 6 of its key (it is place 7)");
        assert_eq!(parked.settlement, Settlement::Republish(Republish::Park { reason, retry_count: 1 }));
    }
}
