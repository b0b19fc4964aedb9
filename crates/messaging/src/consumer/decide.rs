//! What becomes of a delivery, decided in one place and free of I/O. [`Decision`] is fed what
//! happened (the delivery arrived, its start was counted, its transaction ended, the session
//! ended) and answers with the next [`Step`]: try something on the database, wait out an outage,
//! or settle. [`drive`] runs that loop, performing each step through a function it is given, so
//! that the whole table below is tested here, on paused time, without a database or a broker.
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

use std::{future::Future, time::Duration};

use messaging_core::handler::{HandlerError, Reason};

use crate::{
    runtime::{backoff::Backoff, shutdown::Shutdown},
    topology::RetryPolicy,
};

/// The outcome of the transaction for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Applied {
    Done,
    Duplicate,
    /// Rolled back, nothing applied: its endpoint is ordered by key, and the key has not passed
    /// place `follows`, the earlier message this one waits for.
    Waits {
        follows: i64,
    },
}

/// Deferrals a message may take before it is parked: a generous bound on a wait that only a bug
/// could make endless (an earlier message that never comes).
pub(super) const MAX_DEFERRALS: u32 = 10_000;

/// The endpoint's settings a decision reads.
#[derive(Debug, Clone)]
pub(super) struct Rules {
    /// Retry tiers and attempt cap.
    pub(super) policy: RetryPolicy,
    /// Starts of a redelivery, alone and never finished, before it is parked.
    pub(super) max_crashes: u32,
    /// Between tries while the database is unreachable.
    pub(super) reconnect: Backoff,
}

/// What is known of a delivery when it arrives, read from its properties.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Arrival {
    /// The broker's `redelivered` flag: it may be the message that crashed the last process.
    pub(super) redelivered: bool,
    /// Retries before this delivery.
    pub(super) retry_count: u32,
    /// Times it was sent back to wait for an earlier message of its key.
    pub(super) deferrals: u32,
    /// Its place among its key's messages, if it has one.
    pub(super) place: Option<i64>,
}

/// Something tried on the database, whose outcome is reported back as an [`Event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Attempt {
    /// Commit one more start of the message in the crash ledger; report [`Event::Started`].
    CountStart,
    /// Run its transaction (inbox row, turn, handler, commit); report [`Event::Applied`].
    Apply,
}

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
    /// The database is unreachable: wait `delay`, unless the session ends first, then try
    /// `again`.
    WaitOut {
        /// The wait, from the reconnect backoff.
        delay: Duration,
        /// What is tried after it.
        again: Attempt,
        /// What the database answered.
        error: Reason,
    },
    /// Done deciding.
    Settle(Settlement),
}

/// How a delivery leaves this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Settlement {
    /// Ack it: its transaction committed, or the inbox had seen it.
    Ack(Applied),
    /// Publish a copy, then ack: held beside the session's work, where a broker blocking
    /// publishers holds it and not the deliveries behind.
    Republish(Republish),
    /// Leave it unacked: the broker redelivers it when the channel closes.
    HandBack,
}

/// The copy a settlement publishes (confirmed) before its ack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Republish {
    /// To the wait tier for `delay`, with one more retry.
    Retry {
        /// The wait tier.
        delay: Duration,
        /// Why, recorded on the `job.retry_scheduled` event.
        error: String,
        /// Retries before this delivery.
        retry_count: u32,
    },
    /// To the parking queue, with `reason`.
    Park {
        /// Why, recorded on the parked copy and its `job.quarantined` event.
        reason: String,
        /// Retries before this delivery.
        retry_count: u32,
    },
    /// To the first wait tier, its deferrals counted and its attempts untouched: it waits for
    /// place `follows` of its key.
    Defer {
        /// The place it waits for.
        follows: i64,
        /// The first wait tier.
        delay: Duration,
        /// Its deferrals, this one included.
        deferrals: u32,
    },
}

/// One delivery's way through the table of this module.
#[derive(Debug)]
pub(super) struct Decision<'r> {
    rules: &'r Rules,
    arrival: Arrival,
    /// Unanswered tries in a row (the backoff's exponent).
    outages: u32,
    /// What becomes of its start in the crash ledger once it leaves.
    start: Start,
}

/// A redelivery's start in the crash ledger, and when it is forgotten. Once the delivery leaves
/// this process alive (settled, or handed back: a copy not confirmed, an ack that failed, the
/// session's end), its start was no crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// Not counted (a first delivery, or a session that ended before the ledger answered).
    NotCounted,
    /// Forgotten whatever way the delivery leaves.
    Forget,
    /// Parked for crashing its consumer: forgotten only once the parked copy is confirmed and the
    /// delivery acked. If it is not (the copy refused, or the delivery left unacked when the session
    /// ended first), the count stays, and when the delivery comes back it is parked at once instead
    /// of crashing its consumer again.
    ForgetOnceParked,
}

impl<'r> Decision<'r> {
    /// A delivery that could not be read is parked at once.
    pub(super) fn unreadable(arrival: Arrival, why: &impl std::fmt::Display) -> Settlement {
        Settlement::Republish(Republish::Park { reason: why.to_string(), retry_count: arrival.retry_count })
    }

    /// A readable delivery arrived; its first step.
    pub(super) fn arrived(rules: &'r Rules, arrival: Arrival) -> (Self, Step) {
        let first = if arrival.redelivered { Attempt::CountStart } else { Attempt::Apply };
        (Self { rules, arrival, outages: 0, start: Start::NotCounted }, Step::Try(first))
    }

    /// What becomes of its start in the crash ledger once it leaves ([`Start`]).
    pub(super) fn start(&self) -> Start {
        self.start
    }

    /// The step after `event`.
    pub(super) fn next(&mut self, event: Event) -> Step {
        let again = match &event {
            Event::Started(_) => Attempt::CountStart,
            Event::Applied(_) => Attempt::Apply,
            Event::SessionEnded => return Step::Settle(Settlement::HandBack),
        };
        match event {
            Event::Started(Err(HandlerError::Unavailable(error)))
            | Event::Applied(Err(HandlerError::Unavailable(error))) => {
                let delay = self.rules.reconnect.delay(self.outages);
                self.outages = self.outages.saturating_add(1);
                return Step::WaitOut { delay, again, error };
            }
            _ => self.outages = 0,
        }
        match event {
            Event::Started(Ok(starts)) => {
                self.start = Start::Forget;
                if starts > self.rules.max_crashes {
                    self.start = Start::ForgetOnceParked;
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
                self.start = Start::Forget;
                Step::Try(Attempt::Apply)
            }
            Event::Applied(Ok(Applied::Waits { follows })) => self.defer(follows),
            Event::Applied(Ok(applied)) => Step::Settle(Settlement::Ack(applied)),
            Event::Applied(Err(HandlerError::Transient(error) | HandlerError::Unavailable(error))) => {
                let retry_count = self.arrival.retry_count;
                match self.rules.policy.next_delay(retry_count) {
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
    fn defer(&self, follows: i64) -> Step {
        let deferrals = self.arrival.deferrals.saturating_add(1);
        match self.rules.policy.delays().first().filter(|_| deferrals <= MAX_DEFERRALS) {
            Some(&delay) => Step::Settle(Settlement::Republish(Republish::Defer { follows, delay, deferrals })),
            None => {
                let place = self.arrival.place.unwrap_or(0);
                self.park(format!("waited {MAX_DEFERRALS} times for place {follows} of its key (it is place {place})"))
            }
        }
    }
}

/// Run `decision` from its `first` step to its settlement: each [`Attempt`] through `perform`,
/// each outage waited out on `ended` (which cuts a wait short when the session ends). `held` is
/// called once, when the first outage begins, and what it returns is kept until this returns:
/// the delivery counts as held for its database meanwhile.
pub(super) async fn drive<F, Fut, G>(
    decision: &mut Decision<'_>,
    first: Step,
    ended: &Shutdown,
    mut held: impl FnMut() -> G,
    mut perform: F,
) -> Settlement
where
    F: FnMut(Attempt) -> Fut,
    Fut: Future<Output = Event>,
{
    let mut holding = None;
    let mut step = first;
    loop {
        step = match step {
            Step::Settle(settlement) => return settlement,
            Step::Try(attempt) => decision.next(perform(attempt).await),
            Step::WaitOut { delay, again, error } => {
                holding.get_or_insert_with(&mut held);
                tracing::warn!(%error, ?delay, "the database cannot work now (unreachable, refusing writes, out of resources); will try again");
                if ended.sleep(delay).await { Step::Try(again) } else { decision.next(Event::SessionEnded) }
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::VecDeque, time::Duration};

    use tokio::time::Instant;

    use super::{
        Applied, Arrival, Attempt, Decision, Event, HandlerError, MAX_DEFERRALS, Republish, Rules, Settlement, Start,
        drive,
    };
    use crate::{
        runtime::{backoff::Backoff, shutdown},
        topology::RetryPolicy,
    };

    const TIER: Duration = Duration::from_secs(5);

    fn rules() -> Rules {
        Rules {
            policy: RetryPolicy::new(vec![TIER, Duration::from_secs(30)], 3),
            max_crashes: 2,
            reconnect: Backoff::new(Duration::from_millis(100), Duration::from_secs(10)),
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

    /// Drive a delivery that arrived as `arrival` through `events`, answered in order to its
    /// attempts, on paused time; the session ends at `session_ends`, if given. Returns the
    /// settlement, what was attempted and when (from the start), the time it took, and whether
    /// its start is to be forgotten.
    async fn run(
        arrival: Arrival,
        events: Vec<Event>,
        session_ends: Option<Duration>,
    ) -> (Settlement, Vec<(Attempt, Duration)>, Duration, Start) {
        let rules = rules();
        let (trigger, ended) = shutdown::channel();
        let ends = session_ends.unwrap_or(Duration::MAX);
        let session = tokio::spawn(async move {
            tokio::time::sleep(ends).await;
            trigger.trigger();
        });
        let started = Instant::now();
        let mut events = VecDeque::from(events);
        let mut attempts = Vec::new();
        let (mut decision, first) = Decision::arrived(&rules, arrival);
        let perform = |attempt| {
            attempts.push((attempt, started.elapsed()));
            std::future::ready(events.pop_front().expect("an outcome for every attempt"))
        };
        let settlement = drive(&mut decision, first, &ended, || (), perform).await;
        session.abort();
        if session_ends.is_none() {
            assert!(events.is_empty(), "every scripted outcome is used");
        }
        (settlement, attempts, started.elapsed(), decision.start())
    }

    fn first() -> Arrival {
        Arrival::default()
    }

    #[tokio::test(start_paused = true)]
    async fn an_applied_delivery_or_a_duplicate_is_acked_at_once() {
        for applied in [Applied::Done, Applied::Duplicate] {
            let (settlement, attempts, took, forget) = run(first(), vec![Event::Applied(Ok(applied))], None).await;
            assert_eq!(settlement, Settlement::Ack(applied));
            assert_eq!(attempts, [(Attempt::Apply, Duration::ZERO)]);
            assert_eq!((took, forget), (Duration::ZERO, Start::NotCounted));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_transient_failure_is_retried_in_its_tier_until_the_last_attempt_which_parks() {
        let (settlement, ..) = run(first(), vec![Event::Applied(Err(transient()))], None).await;
        assert_eq!(
            settlement,
            Settlement::Republish(Republish::Retry { delay: TIER, error: "deadlock".into(), retry_count: 0 })
        );

        let second = Arrival { retry_count: 1, ..first() };
        let (settlement, ..) = run(second, vec![Event::Applied(Err(transient()))], None).await;
        assert_eq!(
            settlement,
            Settlement::Republish(Republish::Retry {
                delay: Duration::from_secs(30),
                error: "deadlock".into(),
                retry_count: 1
            })
        );

        let last = Arrival { retry_count: 2, ..first() };
        let (settlement, ..) = run(last, vec![Event::Applied(Err(transient()))], None).await;
        assert_eq!(
            settlement,
            Settlement::Republish(Republish::Park {
                reason: "gave up after 3 attempts: deadlock".into(),
                retry_count: 2
            })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_failure_is_parked_with_its_reason_on_any_attempt() {
        let (settlement, ..) = run(first(), vec![Event::Applied(Err(permanent()))], None).await;
        assert_eq!(
            settlement,
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

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_waited_out_with_backoff_spending_no_attempt() {
        let events = vec![
            Event::Applied(Err(outage())),
            Event::Applied(Err(outage())),
            Event::Applied(Err(outage())),
            Event::Applied(Err(transient())),
        ];
        let (settlement, attempts, took, _) = run(first(), events, None).await;
        // The retry is the first one: the outage spent nothing.
        assert_eq!(
            settlement,
            Settlement::Republish(Republish::Retry { delay: TIER, error: "deadlock".into(), retry_count: 0 })
        );
        assert_eq!(attempts.len(), 4);
        // Waits of 100, 200 and 400 ms, each jittered to between half and all of it.
        let waits: Vec<Duration> = attempts.windows(2).map(|pair| pair[1].1 - pair[0].1).collect();
        for (wait, full) in waits.iter().zip([100, 200, 400]) {
            let full = Duration::from_millis(full);
            assert!(*wait >= full / 2 && *wait <= full, "{wait:?} within half of {full:?}");
        }
        assert_eq!(took, attempts[3].1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_that_outlasts_the_session_hands_the_delivery_back() {
        let events = (0..20).map(|_| Event::Applied(Err(outage()))).collect::<Vec<_>>();
        let ends = Duration::from_secs(3);
        let rules = rules();
        let (trigger, ended) = shutdown::channel();
        tokio::spawn(async move {
            tokio::time::sleep(ends).await;
            trigger.trigger();
        });
        let started = Instant::now();
        let mut events = VecDeque::from(events);
        let (mut decision, first) = Decision::arrived(&rules, first());
        let mut holds = 0;
        let perform = |_| std::future::ready(events.pop_front().expect("an outcome for every attempt"));
        let settlement = drive(&mut decision, first, &ended, || holds += 1, perform).await;
        assert_eq!(settlement, Settlement::HandBack);
        // Handed back when the session ended, not at the end of a wait.
        assert_eq!(started.elapsed(), ends);
        assert_eq!(holds, 1, "counted as held once, for the whole outage");
        assert!(!events.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_redelivery_counts_its_start_first_and_is_parked_once_it_has_crashed_too_often() {
        let redelivered = Arrival { redelivered: true, ..first() };
        let (settlement, attempts, _, forget) =
            run(redelivered, vec![Event::Started(Ok(2)), Event::Applied(Ok(Applied::Done))], None).await;
        assert_eq!(settlement, Settlement::Ack(Applied::Done));
        assert_eq!(
            attempts.iter().map(|(attempt, _)| *attempt).collect::<Vec<_>>(),
            [Attempt::CountStart, Attempt::Apply]
        );
        assert_eq!(forget, Start::Forget, "a start that did not crash is forgotten");

        let (settlement, attempts, _, forget) = run(redelivered, vec![Event::Started(Ok(3))], None).await;
        let reason = "crashed its consumer 2 times: handled alone, it never finished (process killed, panicked or \
                      hung); not handled again";
        assert_eq!(settlement, Settlement::Republish(Republish::Park { reason: reason.into(), retry_count: 0 }));
        assert_eq!(attempts.len(), 1, "not applied again");
        assert_eq!(forget, Start::ForgetOnceParked, "its count stays until it is parked");
    }

    #[tokio::test(start_paused = true)]
    async fn a_crash_ledger_that_fails_or_is_unreachable_does_not_keep_a_redelivery_from_its_handler() {
        let redelivered = Arrival { redelivered: true, ..first() };
        let (settlement, _, _, forget) =
            run(redelivered, vec![Event::Started(Err(permanent())), Event::Applied(Ok(Applied::Done))], None).await;
        assert_eq!((settlement, forget), (Settlement::Ack(Applied::Done), Start::Forget));

        // Unreachable: counted once it answers, then applied.
        let events = vec![Event::Started(Err(outage())), Event::Started(Ok(1)), Event::Applied(Ok(Applied::Done))];
        let (settlement, attempts, _, forget) = run(redelivered, events, None).await;
        assert_eq!((settlement, forget), (Settlement::Ack(Applied::Done), Start::Forget));
        let tried: Vec<Attempt> = attempts.iter().map(|(attempt, _)| *attempt).collect();
        assert_eq!(tried, [Attempt::CountStart, Attempt::CountStart, Attempt::Apply]);

        // The session ends before the ledger answers: handed back, nothing to forget.
        let events = (0..10).map(|_| Event::Started(Err(outage()))).collect();
        let (settlement, _, took, forget) = run(redelivered, events, Some(Duration::from_millis(250))).await;
        assert_eq!((settlement, took, forget), (Settlement::HandBack, Duration::from_millis(250), Start::NotCounted));
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_that_waits_for_its_key_is_deferred_without_spending_an_attempt_then_parked_at_the_bound() {
        let waiting = Arrival { retry_count: 1, deferrals: 4, place: Some(7), ..first() };
        let (settlement, ..) = run(waiting, vec![Event::Applied(Ok(Applied::Waits { follows: 6 }))], None).await;
        assert_eq!(settlement, Settlement::Republish(Republish::Defer { follows: 6, delay: TIER, deferrals: 5 }));

        let worn = Arrival { deferrals: MAX_DEFERRALS, ..waiting };
        let (settlement, ..) = run(worn, vec![Event::Applied(Ok(Applied::Waits { follows: 6 }))], None).await;
        let reason = format!("waited {MAX_DEFERRALS} times for place 6 of its key (it is place 7)");
        assert_eq!(settlement, Settlement::Republish(Republish::Park { reason, retry_count: 1 }));
    }
}
