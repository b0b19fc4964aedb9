//! Ordering per key (decisions 0017, 0024). The outbox numbers the messages of each ordering key
//! as their rows are inserted, and gives each, for every type, the place of its key's latest
//! earlier message of that type (migrations `0102_ordering_keys.sql`, `0106_ordering_gaps.sql`).
//! An endpoint ordered by key keeps, for each key, the place it applies next
//! (`inbox_key_positions`), in the same transaction as the inbox row and the effect. A message
//! *follows* the latest earlier message of a type the endpoint takes ([`Ordering::follows`]):
//! the others never come here, so it does not wait for them.
//!
//! - the message whose place is next, or whose key has passed the place it follows, is applied,
//!   and the key moves past it;
//! - a message whose key has not passed the place it follows rolls back and goes to wait (the
//!   first wait tier, with no attempt spent), to be tried again; later messages of its key do the
//!   same, other keys flow;
//! - a message whose place is already passed (it was parked, which gives up its place, and then
//!   redriven) is applied, and the key stays where it is.
//!
//! A parked message gives up its place: if the key is not there yet, the place is written down
//! (`inbox_key_given_up`) and the key steps over it when it gets there.
//!
//! The key's row is locked from the moment a message takes its turn until its transaction ends:
//! two consumers with consecutive messages of one key apply them one after the other. The SQL of
//! both moves is in the migration, as two functions (`inbox_take_turn`, `inbox_give_up_place`).

use lapin::types::AMQPValue;
use messaging_core::envelope::{self, Incoming, Ordering};
use sqlx::PgConnection;

use super::{Handler, Runtime, acks::InFlight};
use crate::{
    outage,
    publisher::{PublishError, Publisher},
    runtime::{db, metrics::Handled, shutdown::Shutdown},
    topology::Endpoint,
};

/// Where a message stands among its key's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Turn {
    /// Its key has passed the place it follows: apply it; the key has moved past it (in this
    /// transaction).
    Now,
    /// Its place was passed (it was parked, then redriven): apply it; the key stays.
    Late,
    /// The message at place `follows`, an earlier one of its key, is not applied yet.
    Waits {
        /// The place this message waits for.
        follows: i64,
    },
}

/// Take `ordering`'s turn at `endpoint` in `tx`: one call, which creates the key's row at place 1
/// if it has none, moves it past this message if its turn has come, and locks it until `tx` ends.
pub(super) async fn take_turn(tx: &mut PgConnection, endpoint: &Endpoint, ordering: &Ordering) -> sqlx::Result<Turn> {
    let follows = ordering.follows(|message_type| endpoint.takes(message_type));
    let was: i64 = sqlx::query_scalar("select inbox_take_turn($1, $2, $3, $4)")
        .bind(endpoint.name)
        .bind(&ordering.key)
        .bind(ordering.seq)
        .bind(follows)
        .fetch_one(tx)
        .await?;
    Ok(turn(ordering.seq, follows, was))
}

/// The message's inbox row ([`inbox::record`](messaging_core::inbox::record)), then its turn as
/// [`take_turn`] takes it, in one statement: one round trip of a transaction instead of two.
/// `None`: the inbox had seen the message, and no turn was taken.
///
/// The insert runs to its end first (a data-modifying CTE always does, waiting on a concurrent
/// copy's row if there is one), and `inbox_take_turn` runs once for each row it returns: once for a
/// new message, never for a copy. That holds while the function stays `volatile` (the default);
/// one declared `stable` could be evaluated apart from the rows. Both lock waits, the inbox row's
/// and the key's, now fall under one `statement_timeout`, which ends the transaction as a
/// transient failure, retried as a `lock_timeout` is.
pub(super) async fn record_and_take_turn(
    tx: &mut PgConnection,
    endpoint: &Endpoint,
    message: &Incoming,
    ordering: &Ordering,
) -> sqlx::Result<Option<Turn>> {
    let follows = ordering.follows(|message_type| endpoint.takes(message_type));
    let was: Option<i64> = sqlx::query_scalar(
        "with recorded as (
            insert into inbox (message_id, message_type, endpoint) values ($1, $2, $3)
            on conflict (message_id) do nothing
            returning 1
         )
         select inbox_take_turn($3, $4, $5, $6) from recorded",
    )
    .bind(message.message_id)
    .bind(&message.message_type)
    .bind(endpoint.name)
    .bind(&ordering.key)
    .bind(ordering.seq)
    .bind(follows)
    .fetch_optional(tx)
    .await?;
    Ok(was.map(|was| turn(ordering.seq, follows, was)))
}

/// The turn of the message at place `seq` that follows place `follows`, its key's next place
/// having been `was` before it took its turn.
fn turn(seq: i64, follows: i64, was: i64) -> Turn {
    if was > seq {
        Turn::Late
    } else if was > follows {
        Turn::Now
    } else {
        Turn::Waits { follows }
    }
}

impl<H: Handler> Runtime<H> {
    /// Give up the place of a message of `message_type` being parked, so that its key's later
    /// messages go on: the key moves past it now if its turn had come, or steps over it when it
    /// gets there. A redrive then applies it late. A message of a type the endpoint does not take
    /// holds no place here (no message of the key waits for it).
    ///
    /// The copy is in parking already, so this must happen. If the database cannot do it now
    /// (unreachable, or a lock held past `lock_timeout`: [`outage::is_unreachable`],
    /// [`outage::lost_to_other_work`]), it is tried again with the reconnect backoff, the delivery
    /// unacked and counted as held by an outage (`consumer_deliveries_held`). Until 2026-12-07 one
    /// failure ended it, and the key waited at this place for good: a cancelled order's
    /// `order.ended` behind a parked `order.placed` was deferred until an operator redrove the
    /// parked message. Returns `false` if the session ends (`ended`) during a wait: the delivery
    /// is then left unacked, comes back, is parked again (a second copy in parking, which a
    /// redrive's inbox skips) and gives up its place then; a park by the crash bound keeps its
    /// start in the crash ledger meanwhile ([`Settled::LeftUnacked`](super::settle::Settled)), so
    /// that it is parked again at once, not handled again. Any other error (a verdict on the
    /// statement, which a retry would repeat) is logged, and the key waits at this place until
    /// the parked message is redriven.
    pub(super) async fn give_up_place(
        &self,
        message_type: Option<&str>,
        ordering: &Ordering,
        ended: &Shutdown,
    ) -> bool {
        let endpoint = &self.settings.endpoint;
        let taken = message_type.is_some_and(|message_type| endpoint.takes(message_type));
        if ordering.earlier.is_some() && !taken {
            return true;
        }
        let follows = ordering.follows(|message_type| endpoint.takes(message_type));
        let give_up = || async {
            let mut conn = db::acquire(&self.pool).await?;
            sqlx::query("select inbox_give_up_place($1, $2, $3, $4)")
                .bind(endpoint.name)
                .bind(&ordering.key)
                .bind(ordering.seq)
                .bind(follows)
                .execute(&mut *conn)
                .await
        };
        let mut failures = 0;
        let mut held = None;
        loop {
            let error = match db::within(db::QUERY_DEADLINE, give_up()).await {
                Ok(_) => return true,
                Err(error) if outage::retry_later(&error) => error,
                Err(error) => {
                    let (key, place) = (&ordering.key, ordering.seq);
                    tracing::error!(%error, key, place, "parked, but its key waits for it: redrive it");
                    return true;
                }
            };
            held.get_or_insert_with(|| self.metrics.held());
            let delay = self.settings.reconnect.delay(failures);
            failures = failures.saturating_add(1);
            tracing::warn!(
                %error,
                ?delay,
                key = ordering.key,
                place = ordering.seq,
                "parked, but its place is not given up yet (its key's later messages wait); will try again"
            );
            if !ended.sleep(delay).await {
                return false;
            }
        }
    }

    /// Send a message that must wait for place `follows` of its key back to the first wait tier
    /// (`delay`), its attempts untouched and its deferrals (`deferrals`, this one included)
    /// counted; then ack it. How many it may take is the machine's (`MAX_DEFERRALS`).
    pub(super) async fn defer(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        follows: i64,
        delay: std::time::Duration,
        deferrals: u32,
    ) -> Result<(), PublishError> {
        let endpoint = &self.settings.endpoint;
        let raw = delivery.delivery();
        let properties = envelope::with_headers(
            &raw.properties,
            &[(envelope::HEADER_DEFERRALS, AMQPValue::LongLongInt(i64::from(deferrals)))],
        );
        publisher.publish(&endpoint.direct_exchange(), &endpoint.wait_queue(delay), &raw.data, properties).await?;
        delivery.ack().await?;
        self.count(Handled::Deferred);
        tracing::info!(follows, ?delay, deferrals, "waits for an earlier message of its key");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Turn, turn};

    #[test]
    fn a_message_is_applied_in_its_turn_or_late_and_otherwise_waits() {
        // Place 3, following 2, the key at 3: its turn.
        assert_eq!(turn(3, 2, 3), Turn::Now);
        assert_eq!(turn(1, 0, 1), Turn::Now);
        // Place 3 follows 1 (place 2 is of a type this endpoint does not take): the key at 2
        // has passed 1, so 3 goes now; at 1, it waits for 1.
        assert_eq!(turn(3, 1, 2), Turn::Now);
        assert_eq!(turn(3, 1, 1), Turn::Waits { follows: 1 });
        // The key is at 6 and stays there: 3 was passed (parked, then redriven).
        assert_eq!(turn(3, 2, 6), Turn::Late);
        // The key is at 2: 3, which follows 2, waits for it.
        assert_eq!(turn(3, 2, 2), Turn::Waits { follows: 2 });
    }
}
