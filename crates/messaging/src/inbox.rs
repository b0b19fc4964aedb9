//! The inbox: the record of messages this database has already processed. Recording a message is
//! the first statement of the handler's transaction, so "processed" commits together with the
//! effect: a redelivered message finds its row and is skipped, never applied twice.

use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

/// Record `message_id` as processed in the caller's transaction. `false` means it was processed
/// before: skip the effect and ack. A concurrent delivery of the same id blocks on the primary
/// key until the first transaction ends, then sees the conflict; so two copies handled at once
/// still apply once.
pub async fn record(
    conn: &mut PgConnection,
    message_id: Uuid,
    message_type: &str,
    endpoint: &str,
) -> sqlx::Result<bool> {
    let inserted = sqlx::query(
        "insert into inbox (message_id, message_type, endpoint) values ($1, $2, $3)
         on conflict (message_id) do nothing",
    )
    .bind(message_id)
    .bind(message_type)
    .bind(endpoint)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(inserted == 1)
}

/// Delete up to `batch` inbox rows received more than `retention` ago, and as many crash counts
/// (`delivery_starts`) last started that long ago; returns the larger of the two counts, so a
/// caller deleting batch after batch goes on while either table has more.
pub async fn delete_received_before(pool: &PgPool, retention: Duration, batch: i64) -> sqlx::Result<u64> {
    let retention = crate::retention::millis(retention);
    let inbox = sqlx::query(
        "delete from inbox where message_id in (select message_id from inbox
          where received_at < now() - $1 * interval '1 millisecond' limit $2)",
    )
    .bind(retention)
    .bind(batch)
    .execute(pool)
    .await?
    .rows_affected();
    let starts = sqlx::query(
        "delete from delivery_starts where (endpoint, message_id) in (select endpoint, message_id from delivery_starts
          where last_started_at < now() - $1 * interval '1 millisecond' limit $2)",
    )
    .bind(retention)
    .bind(batch)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(inbox.max(starts))
}
