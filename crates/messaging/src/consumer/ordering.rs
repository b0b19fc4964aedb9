//! Ordering per key (decision 0017). The outbox numbers the messages of each ordering key as their
//! rows are inserted (migration `0102_ordering_keys.sql`); an endpoint ordered by key keeps, for
//! each key, the place it applies next (`inbox_key_positions`), in the same transaction as the
//! inbox row and the effect:
//!
//! - the message whose place is next is applied, and the key moves on by one;
//! - a message whose place is further on rolls back and goes to wait (the first wait tier, with no
//!   attempt spent), to be tried again; later messages of its key do the same, other keys flow;
//! - a message whose place is already passed (it was parked, which gives up its place, and then
//!   redriven) is applied, and the key stays where it is.
//!
//! The key's row is locked from the moment a message takes its turn until its transaction ends:
//! two consumers with consecutive messages of one key apply them one after the other.

use lapin::types::AMQPValue;
use sqlx::PgConnection;

use super::{Handler, Runtime, acks::InFlight};
use crate::{
    envelope::{self, Incoming, Ordering},
    publisher::{PublishError, Publisher},
    runtime::{db, metrics::Handled},
};

/// Where a message stands among its key's messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Turn {
    /// Its place is next: apply it; the key has moved on (in this transaction).
    Now,
    /// Its place was passed (it was parked, then redriven): apply it; the key stays.
    Late,
    /// An earlier message of its key is not applied yet: the key's next place is this one.
    Waits {
        /// The key's next place.
        next: i64,
    },
}

/// Take `ordering`'s turn at `endpoint` in `tx`: one statement, which creates the key's row at
/// place 1 if it has none, moves it on if this message's place is next, and locks it until `tx`
/// ends.
pub(super) async fn take_turn(tx: &mut PgConnection, endpoint: &str, ordering: &Ordering) -> sqlx::Result<Turn> {
    let next: i64 = sqlx::query_scalar(
        "insert into inbox_key_positions as p (endpoint, key, next)
         values ($1, $2, case when $3 = 1 then 2 else 1 end)
         on conflict (endpoint, key) do update
            set next = case when p.next = $3 then $3 + 1 else p.next end
         returning next",
    )
    .bind(endpoint)
    .bind(&ordering.key)
    .bind(ordering.seq)
    .fetch_one(tx)
    .await?;
    Ok(turn(ordering.seq, next))
}

/// The turn of the message at place `seq`, the key's next place being `next` after the statement.
fn turn(seq: i64, next: i64) -> Turn {
    if next == seq + 1 {
        Turn::Now
    } else if next > seq {
        Turn::Late
    } else {
        Turn::Waits { next }
    }
}

/// Give up the place of a message being parked, so that its key's later messages go on: the key
/// moves past it if it was next. A redrive then applies it late. If the database cannot be
/// reached, the key stays at this place until the message is redriven (then applied in turn).
pub(super) async fn give_up_place(pool: &sqlx::PgPool, endpoint: &str, ordering: &Ordering) {
    let given_up = async {
        let mut conn = db::acquire(pool).await?;
        take_turn(&mut conn, endpoint, ordering).await
    };
    if let Err(error) = db::within(db::QUERY_DEADLINE, given_up).await {
        tracing::warn!(%error, key = ordering.key, place = ordering.seq, "parked, but its key waits for it: redrive it");
    }
}

/// Deferrals a message may take before it is parked: a generous bound on a wait that only a bug
/// could make endless (an earlier message that never comes).
pub(super) const MAX_DEFERRALS: u32 = 10_000;

impl<H: Handler> Runtime<H> {
    /// Send a message that must wait for an earlier one of its key back to the first wait tier,
    /// its attempts untouched and its deferrals counted; then ack it. After
    /// [`MAX_DEFERRALS`] it is parked instead, with the place its key is stuck at.
    pub(super) async fn defer(
        &self,
        delivery: InFlight,
        publisher: &Publisher,
        message: &Incoming,
        next: i64,
    ) -> Result<(), PublishError> {
        let endpoint = &self.settings.endpoint;
        let raw = delivery.delivery();
        let deferrals =
            raw.properties.headers().as_ref().and_then(|h| envelope::header_u32(h, envelope::HEADER_DEFERRALS));
        let deferrals = deferrals.unwrap_or(0) + 1;
        let Some(&delay) = self.settings.policy.delays().first().filter(|_| deferrals <= MAX_DEFERRALS) else {
            let place = message.ordering.as_ref().map_or(0, |ordering| ordering.seq);
            let reason = format!("waited {MAX_DEFERRALS} times for place {next} of its key (it is place {place})");
            return self.park(delivery, publisher, message.retry_count, &reason).await;
        };
        let properties = envelope::with_headers(
            &raw.properties,
            &[(envelope::HEADER_DEFERRALS, AMQPValue::LongLongInt(i64::from(deferrals)))],
        );
        publisher.publish(&endpoint.direct_exchange(), &endpoint.wait_queue(delay), &raw.data, properties).await?;
        delivery.ack().await?;
        self.count(Handled::Deferred);
        tracing::info!(next, ?delay, deferrals, "waits for an earlier message of its key");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Turn, turn};

    #[test]
    fn a_message_is_applied_in_its_turn_or_late_and_otherwise_waits() {
        // The statement's `next` after it ran: moved on past 3 means 3 was next.
        assert_eq!(turn(3, 4), Turn::Now);
        assert_eq!(turn(1, 2), Turn::Now);
        // The key is at 6 and stays there: 3 was passed (parked, then redriven).
        assert_eq!(turn(3, 6), Turn::Late);
        // The key is at 2: 3 waits for 2.
        assert_eq!(turn(3, 2), Turn::Waits { next: 2 });
    }
}
