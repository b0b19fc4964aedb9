//! A publisher with publisher confirms, where a broker `nack` or a `mandatory` return is an error,
//! never a success. Sends can be pipelined: [`Publisher::send`] puts a message on the wire and
//! returns its pending confirm, so a batch costs one round trip instead of one per message.
//!
//! Which message a `basic.return` belongs to is decided here, by its `message_id`, and not by
//! the confirm lapin hands it to. The broker only promises that a message's return comes before
//! its ack; acks of other messages may come in between (a quorum queue confirms later than an
//! unroutable message is returned), and one ack may cover several messages. lapin gives each
//! return to the next confirm it resolves, so a return could be pinned on a delivered neighbour
//! while the message that went nowhere counted as confirmed: a lost message (pinned by
//! `broker_semantics::pipelined_publishes_report_exactly_the_unroutable_ones_as_returned`).
//!
//! So every confirm of a channel is collected in one `Ledger`, in publish order, and a publish's
//! outcome is given only once it *and every publish before it* is resolved: by then its return,
//! if it had one, has been handed to some confirm and collected. (Returns come in publish order,
//! each before its own ack, and lapin hands out each return at the latest when every publish up
//! to its own is resolved.) A return without a `message_id` cannot be matched, and stays with the
//! confirm that carried it, as lapin has it; every message this project sends has an id.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    task::{Context, Poll, Wake, Waker},
    time::Duration,
};

use lapin::{
    BasicProperties, Channel, Confirmation, Connection, PublisherConfirm,
    options::{BasicPublishOptions, ConfirmSelectOptions},
};

/// Why a message was not accepted by the broker.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// `mandatory` and no queue is bound for it: it went nowhere.
    #[error("unroutable: returned by the broker ({0})")]
    Returned(String),
    /// The broker refused to take responsibility for it (e.g. a queue at its limit).
    #[error("nacked by the broker")]
    Nacked,
    /// The channel or connection failed: whether the message arrived is unknown.
    #[error("broker connection: {0}")]
    Connection(#[from] lapin::Error),
    /// No confirm came within the publisher's deadline ([`Publisher::with_confirm_timeout`]): a
    /// broker that blocks publishers (a resource alarm), a queue without a majority, or a
    /// connection gone silent. Whether the message arrived is unknown, and the channel is not to
    /// be trusted with more.
    #[error("no confirm from the broker within {}", crate::runtime::duration::format_duration(*.0))]
    TimedOut(Duration),
}

impl PublishError {
    /// Whether the channel is unusable and must be reopened (as opposed to a refusal of one
    /// message on a healthy channel): it failed, or a confirm is overdue.
    pub fn is_connection(&self) -> bool {
        matches!(self, Self::Connection(_) | Self::TimedOut(_))
    }
}

/// A channel in confirm mode. Publish on it only through [`Publisher::send`] (or `publish`): a
/// message sent on the channel directly would have its confirm and return go unaccounted.
///
/// ```no_run
/// use messaging::{envelope::Headers, publisher::{PublishError, Publisher}};
///
/// # async fn notify(connection: &lapin::Connection, body: &[u8]) -> Result<(), PublishError> {
/// let publisher = Publisher::open(connection).await?;
/// let properties = Headers::raw(None, 1).properties(uuid::Uuid::now_v7(), "parcel.shipped", chrono::Utc::now());
/// // Returns once the broker has confirmed it; unroutable (returned) or nacked is an error.
/// publisher.publish("shipping", "parcel.shipped", body, properties).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    confirms: Arc<Confirms>,
    confirm_timeout: Duration,
}

/// How long a publish waits for its confirm unless told otherwise ([`Publisher::with_confirm_timeout`],
/// `CONFIRM_TIMEOUT`).
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

impl Publisher {
    /// Open a channel on `connection` and put it in confirm mode; confirms are waited for
    /// [`CONFIRM_TIMEOUT`].
    pub async fn open(connection: &Connection) -> lapin::Result<Self> {
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(Self { channel, confirms: Arc::default(), confirm_timeout: CONFIRM_TIMEOUT })
    }

    /// The same publisher, whose publishes wait at most `timeout` from the call to send them for
    /// their confirm, then fail with [`PublishError::TimedOut`]. Without a deadline, a broker that
    /// blocks the connection (a resource alarm) or a queue that lost its majority would hold the
    /// waiter for as long as that lasts, on a connection that looks healthy.
    pub fn with_confirm_timeout(self, timeout: Duration) -> Self {
        Self { confirm_timeout: timeout, ..self }
    }

    /// The underlying channel (for declarations).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Publish (mandatory) and wait for the broker's confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<(), PublishError> {
        self.send(exchange, routing_key, payload, properties).await?.confirmed().await
    }

    /// Put a message on the wire (mandatory) without waiting; await the returned [`Pending`] to
    /// learn whether the broker took it.
    pub async fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        properties: BasicProperties,
    ) -> Result<Pending, PublishError> {
        let message_id = properties.message_id().as_ref().map(ToString::to_string);
        // The deadline counts from here: on a connection the broker blocks, lapin writes no frame,
        // and the publish itself never completes (nor, behind it, the next one's).
        let deadline = tokio::time::Instant::now() + self.confirm_timeout;
        let sent = tokio::time::timeout_at(deadline, async {
            // Held until the publish is in the ledger, so that the ledger's order is the wire's.
            let _in_order = self.confirms.sending.lock().await;
            let confirm = self
                .channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() },
                    payload,
                    properties,
                )
                .await?;
            Ok::<_, lapin::Error>(self.confirms.track(message_id, confirm))
        });
        let seq = sent.await.map_err(|_| PublishError::TimedOut(self.confirm_timeout))??;
        Ok(Pending {
            seq,
            confirms: Arc::clone(&self.confirms),
            settled: false,
            deadline,
            timeout: self.confirm_timeout,
        })
    }

    /// Close the channel politely (after every confirm has been awaited).
    pub async fn close(&self) {
        let _ = self.channel.close(200, "bye".into()).await;
    }
}

/// A sent message whose confirm has not arrived yet. Dropping it forgets the outcome, so the
/// type is `must_use`: a fire-and-forget publish is exactly what this module exists to prevent.
#[must_use = "a publish is only safe once its confirm has been awaited"]
pub struct Pending {
    seq: u64,
    confirms: Arc<Confirms>,
    settled: bool,
    /// When the confirm is overdue: the publisher's timeout after the call to send.
    deadline: tokio::time::Instant,
    timeout: Duration,
}

impl Pending {
    /// Wait for the confirm (and for every earlier publish's, see the module's documentation); a
    /// return (unroutable) or a nack is an error, and so is no confirm by the deadline
    /// ([`PublishError::TimedOut`]).
    pub async fn confirmed(mut self) -> Result<(), PublishError> {
        let outcome = std::future::poll_fn(|cx| self.confirms.poll_outcome(self.seq, cx));
        let outcome = match tokio::time::timeout_at(self.deadline, outcome).await {
            Ok(outcome) => outcome,
            // Left unsettled: dropping it abandons the entry, as for any outcome nobody takes.
            Err(_) => return Err(PublishError::TimedOut(self.timeout)),
        };
        self.settled = true;
        outcome
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.settled {
            self.confirms.abandon(self.seq);
        }
    }
}

/// The confirms of one publisher's channel.
#[derive(Default)]
struct Confirms {
    /// Held across a publish and its entry in the ledger.
    sending: tokio::sync::Mutex<()>,
    ledger: Mutex<Ledger>,
    wakeups: Arc<Wakeups>,
}

/// Every publish whose outcome has not been taken yet, by sequence number (publish order), and
/// the returns collected from their confirms.
#[derive(Default)]
struct Ledger {
    next: u64,
    entries: BTreeMap<u64, Entry>,
    /// The entries whose confirm has not resolved.
    unresolved: BTreeSet<u64>,
    /// The entries whose [`Pending`] was dropped: removed, with their return, once nothing before
    /// them is unresolved.
    abandoned: BTreeSet<u64>,
    /// Returns collected and not yet claimed, by the `message_id` they carry: the reply.
    returned: HashMap<String, Vec<String>>,
}

struct Entry {
    message_id: Option<String>,
    state: State,
}

enum State {
    /// The confirm, and the waker that records its resolution.
    Waiting(PublisherConfirm, Waker),
    Resolved(Outcome),
}

/// A confirm's own verdict, before returns are matched.
enum Outcome {
    Ack,
    Nack,
    /// It carried a return without a `message_id`: taken as its own.
    Returned(String),
    Failed(lapin::Error),
}

impl Confirms {
    /// Enter a publish just put on the wire; its sequence number.
    fn track(&self, message_id: Option<String>, confirm: PublisherConfirm) -> u64 {
        // The ledger first: see `poll_outcome`.
        let mut ledger = lock(&self.ledger);
        let resolved = self.wakeups.take_resolved();
        let seq = ledger.next;
        ledger.next += 1;
        let waker = Waker::from(Arc::new(Resolution { seq, wakeups: Arc::clone(&self.wakeups) }));
        let entry = Entry { message_id, state: State::Waiting(confirm, waker) };
        ledger.entries.insert(seq, entry);
        ledger.unresolved.insert(seq);
        // Polled once now, so that its resolution wakes whoever waits; collect what resolved since
        // the last look, so that a publisher whose confirms nobody awaits does not grow.
        ledger.collect_all(resolved.into_iter().chain([seq]));
        seq
    }

    /// The outcome of publish `seq`, once it and every publish before it are resolved.
    fn poll_outcome(&self, seq: u64, cx: &mut Context<'_>) -> Poll<Result<(), PublishError>> {
        // The resolutions are taken and collected under the ledger's lock, so that whoever holds it
        // next sees them. Taken before it, by another task, a resolution could be collected only
        // after this task had looked and registered: its wake spent, this task would sleep until
        // its deadline although every publish up to its own had resolved (a lost wakeup, seen in
        // CI as a retry left unacked, when confirms for two queues came out of publish order).
        let mut ledger = lock(&self.ledger);
        // Registered before looking, so that a resolution after the look wakes this task.
        let resolved = self.wakeups.wait(seq, cx.waker());
        ledger.collect_all(resolved);
        if ledger.unresolved.first().is_some_and(|&first| first <= seq) {
            return Poll::Pending;
        }
        self.wakeups.forget(seq);
        // Not in `unresolved`, so collected; and only this `Pending` removes it. Were it missing,
        // "not known to be stored" is the safe answer.
        let Some(Entry { message_id, state: State::Resolved(outcome) }) = ledger.entries.remove(&seq) else {
            return Poll::Ready(Err(PublishError::Nacked));
        };
        let returned = message_id.and_then(|id| ledger.claim_return(&id));
        Poll::Ready(match (outcome, returned) {
            (Outcome::Failed(error), _) => Err(PublishError::Connection(error)),
            (_, Some(reply)) | (Outcome::Returned(reply), None) => Err(PublishError::Returned(reply)),
            (Outcome::Ack, None) => Ok(()),
            (Outcome::Nack, None) => Err(PublishError::Nacked),
        })
    }

    /// Its [`Pending`] is gone: nobody will take the outcome.
    fn abandon(&self, seq: u64) {
        self.wakeups.forget(seq);
        let mut ledger = lock(&self.ledger);
        if ledger.entries.contains_key(&seq) {
            ledger.abandoned.insert(seq);
            ledger.sweep_abandoned();
        }
    }
}

impl Ledger {
    /// [`Self::collect`] each of `resolved`, then drop what is abandoned and settled.
    fn collect_all(&mut self, resolved: impl IntoIterator<Item = u64>) {
        for seq in resolved {
            self.collect(seq);
        }
        self.sweep_abandoned();
    }

    /// Look at entry `seq`'s confirm, woken as resolved: its verdict, and the return it carries.
    fn collect(&mut self, seq: u64) {
        let Some(entry) = self.entries.get_mut(&seq) else { return };
        let State::Waiting(confirm, waker) = &mut entry.state else { return };
        let Poll::Ready(result) = Pin::new(confirm).poll(&mut Context::from_waker(waker)) else { return };
        let (outcome, carried) = match result {
            Ok(Confirmation::Ack(carried)) => (Outcome::Ack, carried),
            Ok(Confirmation::Nack(carried)) => (Outcome::Nack, carried),
            // Only reachable if confirm mode was never enabled: "not known to be stored".
            Ok(Confirmation::NotRequested) => (Outcome::Nack, None),
            Err(error) => (Outcome::Failed(error), None),
        };
        let outcome = match carried {
            Some(returned) => {
                let reply = format!("{} {}", returned.reply_code, returned.reply_text);
                match returned.properties.message_id() {
                    Some(id) => {
                        self.returned.entry(id.to_string()).or_default().push(reply);
                        outcome
                    }
                    None => Outcome::Returned(reply),
                }
            }
            None => outcome,
        };
        entry.state = State::Resolved(outcome);
        self.unresolved.remove(&seq);
    }

    /// Take a return collected for `message_id`.
    fn claim_return(&mut self, message_id: &str) -> Option<String> {
        let replies = self.returned.get_mut(message_id)?;
        let reply = replies.pop();
        if replies.is_empty() {
            self.returned.remove(message_id);
        }
        reply
    }

    /// Remove the abandoned publishes whose outcome is settled (they and every publish before
    /// them resolved), with the return each may have had, so that nothing they leave grows.
    fn sweep_abandoned(&mut self) {
        let settled_below = self.unresolved.first().copied().unwrap_or(self.next);
        let settled: Vec<u64> = self.abandoned.range(..settled_below).copied().collect();
        for seq in settled {
            self.abandoned.remove(&seq);
            if let Some(id) = self.entries.remove(&seq).and_then(|entry| entry.message_id) {
                self.claim_return(&id);
            }
        }
    }
}

/// Resolutions recorded by the confirms' wakers, and the tasks waiting for an outcome.
#[derive(Default)]
struct Wakeups(Mutex<WakeupsInner>);

#[derive(Default)]
struct WakeupsInner {
    resolved: Vec<u64>,
    /// By the publish each waits for: the outcome of `seq` can only change when a publish up to
    /// `seq` resolves.
    waiting: BTreeMap<u64, Waker>,
}

impl Wakeups {
    /// Register `waker` for publish `seq`; the resolutions recorded since the last look. Called
    /// with the ledger's lock held, as is [`Self::take_resolved`]: what it takes is collected
    /// before anyone else looks.
    fn wait(&self, seq: u64, waker: &Waker) -> Vec<u64> {
        let mut inner = lock(&self.0);
        match inner.waiting.get_mut(&seq) {
            Some(registered) if registered.will_wake(waker) => {}
            _ => {
                inner.waiting.insert(seq, waker.clone());
            }
        }
        std::mem::take(&mut inner.resolved)
    }

    fn take_resolved(&self) -> Vec<u64> {
        std::mem::take(&mut lock(&self.0).resolved)
    }

    fn forget(&self, seq: u64) {
        lock(&self.0).waiting.remove(&seq);
    }
}

/// The waker of one publish's confirm: records that it resolved, and wakes the tasks waiting for it
/// or for a later publish (an outcome waits on every earlier publish too).
struct Resolution {
    seq: u64,
    wakeups: Arc<Wakeups>,
}

impl Wake for Resolution {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let waiting = {
            let mut inner = lock(&self.wakeups.0);
            inner.resolved.push(self.seq);
            inner.waiting.split_off(&self.seq)
        };
        for waker in waiting.into_values() {
            waker.wake();
        }
    }
}

/// A poisoned lock only means a panic elsewhere while it was held; the data is still consistent
/// (every update is a single step).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
