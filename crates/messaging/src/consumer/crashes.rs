//! The crash ledger: how often a redelivered message started its handler, alone, and never
//! finished. A start is committed before the handler runs; a live process forgets it once the
//! delivery is settled or handed back (a crash park's, once the park is confirmed and acked: `machine::LedgerEntry`),
//! so what stays counted are the starts that ended with the process (a crash, a kill, a panic). The runtime parks a message once the count passes its bound
//! (decision 0005). First deliveries never come here: only redeliveries pay this extra commit.

use sqlx::PgPool;
use uuid::Uuid;

/// Count one more start of `message_id` on `endpoint`, committed at once; returns the count
/// including this one.
pub async fn record_start(pool: &PgPool, endpoint: &str, message_id: Uuid) -> sqlx::Result<u32> {
    let starts: i32 = sqlx::query_scalar(
        "insert into delivery_starts (endpoint, message_id) values ($1, $2)
         on conflict (endpoint, message_id)
         do update set starts = delivery_starts.starts + 1, last_started_at = now()
         returning starts",
    )
    .bind(endpoint)
    .bind(message_id)
    .fetch_one(pool)
    .await?;
    Ok(u32::try_from(starts).unwrap_or(0))
}

/// Forget the starts of `message_id` on `endpoint`: its delivery ended in a live process.
pub async fn forget(pool: &PgPool, endpoint: &str, message_id: Uuid) -> sqlx::Result<()> {
    sqlx::query("delete from delivery_starts where endpoint = $1 and message_id = $2")
        .bind(endpoint)
        .bind(message_id)
        .execute(pool)
        .await
        .map(drop)
}
