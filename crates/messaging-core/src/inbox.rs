//! The inbox: the record of messages this database has already processed. Recording a message is
//! the first statement of the handler's transaction, so "processed" commits together with the
//! effect: a redelivered message finds its row and is skipped, never applied twice.

use sqlx::PgConnection;
use uuid::Uuid;

/// Record `message_id` as processed in the caller's transaction. `false` means it was processed
/// before: skip the effect and ack. A concurrent delivery of the same id blocks on the primary
/// key until the first transaction ends, then sees the conflict; so two copies handled at once
/// still apply once. (The consumer runtime does this for every typed handler; a raw handler that
/// manages its own transaction calls it first.)
///
/// ```no_run
/// # async fn apply(pool: sqlx::PgPool, message_id: uuid::Uuid) -> sqlx::Result<()> {
/// let mut tx = pool.begin().await?;
/// if messaging_core::inbox::record(&mut tx, message_id, "parcel.shipped", "billing.parcel-shipped").await? {
///     // The effect, in the same transaction: it commits with the inbox row, or neither does.
///     sqlx::query("update invoices set shipped = true where message_id = $1").bind(message_id).execute(&mut *tx).await?;
/// }
/// tx.commit().await
/// # }
/// ```
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

/// [`record`] for a batch of messages (id and type) in one statement: for each, in order,
/// whether it is new. Of two copies of one message in the batch, only the first is. The rows
/// are inserted in id order, so that two batches sharing ids wait on each other instead of
/// deadlocking.
pub async fn record_all(conn: &mut PgConnection, messages: &[(Uuid, &str)], endpoint: &str) -> sqlx::Result<Vec<bool>> {
    let ids: Vec<Uuid> = messages.iter().map(|(id, _)| *id).collect();
    let types: Vec<&str> = messages.iter().map(|(_, message_type)| *message_type).collect();
    let inserted: Vec<Uuid> = sqlx::query_scalar(
        "insert into inbox (message_id, message_type, endpoint)
         select id, message_type, $1 from unnest($2::uuid[], $3::text[]) as m (id, message_type) order by id
         on conflict (message_id) do nothing
         returning message_id",
    )
    .bind(endpoint)
    .bind(&ids)
    .bind(&types)
    .fetch_all(conn)
    .await?;
    let mut new: std::collections::HashSet<Uuid> = inserted.into_iter().collect();
    Ok(ids.iter().map(|id| new.remove(id)).collect())
}
