//! The inbox: the record of messages this database has already processed. Recording a message is
//! the first statement of the handler's transaction, so "processed" commits together with the
//! effect: a redelivered message finds its row and is skipped, never applied twice.

use sqlx::PgConnection;
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
