//! Retention: rows that only matter for a while (published outbox rows, inbox rows, stale crash
//! counts) are deleted once they are older than their retention, in small batches so that no long
//! lock is held, at start-up and then hourly.

use std::{future::Future, time::Duration};

use sqlx::PgPool;

use crate::runtime::shutdown::Shutdown;

/// Rows deleted per statement.
pub const BATCH: i64 = 10_000;

/// How often a retention loop wakes up.
pub const EVERY: Duration = Duration::from_secs(3600);

/// Until shutdown: call `delete_batch` (which deletes up to [`BATCH`] rows and says how many went)
/// until it deletes fewer than a batch, then sleep for [`EVERY`]. A failure (the table not there
/// yet, the database down) skips the round.
pub async fn run<F, Fut>(what: &'static str, shutdown: Shutdown, mut delete_batch: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = sqlx::Result<u64>>,
{
    loop {
        let mut deleted = 0;
        loop {
            match delete_batch().await {
                Ok(count) => {
                    deleted += count;
                    if count < BATCH as u64 || shutdown.is_triggered() {
                        break;
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, what, "retention skipped this round");
                    break;
                }
            }
        }
        if deleted > 0 {
            tracing::info!(deleted, what, "rows past retention deleted");
        }
        if !shutdown.sleep(EVERY).await {
            return;
        }
    }
}

/// Run each of `statements` once, in order: each deletes up to `$2` (`batch`) rows older than `$1`
/// milliseconds (`retention`). Returns the most rows one of them deleted, so a caller deleting
/// batch after batch goes on while any table has more.
async fn delete_each(pool: &PgPool, statements: &[&'static str], retention: Duration, batch: i64) -> sqlx::Result<u64> {
    let mut most = 0;
    for statement in statements {
        let deleted = sqlx::query(*statement).bind(millis(retention)).bind(batch).execute(pool).await?.rows_affected();
        most = most.max(deleted);
    }
    Ok(most)
}

/// `retention` as a Postgres interval parameter, in milliseconds.
fn millis(retention: Duration) -> i64 {
    i64::try_from(retention.as_millis()).unwrap_or(i64::MAX)
}

/// Delete up to `batch` rows published more than `retention` ago, and as many ordering keys that
/// have numbered no message for that long (decision 0024: such a key starts again at place 1);
/// returns the larger of the two counts, so a caller deleting batch after batch goes on while
/// either table has more.
pub async fn delete_published_before(pool: &PgPool, retention: Duration, batch: i64) -> sqlx::Result<u64> {
    let statements = [
        "delete from outbox where id in (select id from outbox
          where published_at < now() - $1 * interval '1 millisecond' limit $2)",
        // `numbered_at` checked again on the row deleted: a key that numbered a row meanwhile stays.
        "delete from outbox_key_sequences where key in (select key from outbox_key_sequences
          where numbered_at < now() - $1 * interval '1 millisecond' limit $2)
          and numbered_at < now() - $1 * interval '1 millisecond'",
    ];
    delete_each(pool, &statements, retention, batch).await
}

/// Delete up to `batch` inbox rows received more than `retention` ago, as many crash counts
/// (`delivery_starts`) last started that long ago, and as many ordering keys that have not moved
/// for that long, with their given-up places (decision 0024); returns the largest of the counts,
/// so a caller deleting batch after batch goes on while any table has more.
pub async fn delete_received_before(pool: &PgPool, retention: Duration, batch: i64) -> sqlx::Result<u64> {
    let statements = [
        "delete from inbox where message_id in (select message_id from inbox
          where received_at < now() - $1 * interval '1 millisecond' limit $2)",
        "delete from delivery_starts where (endpoint, message_id) in (select endpoint, message_id from delivery_starts
          where last_started_at < now() - $1 * interval '1 millisecond' limit $2)",
        // Given-up places the key never got to (their key moves, but never reached them).
        "delete from inbox_key_given_up where (endpoint, key, follows) in (select endpoint, key, follows
          from inbox_key_given_up where given_up_at < now() - $1 * interval '1 millisecond' limit $2)",
    ];
    let most = delete_each(pool, &statements, retention, batch).await?;
    // A key is forgotten with its given-up places, so that a key made anew does not step over
    // them. `moved_at` is checked again on the row deleted: a key that moved meanwhile stays.
    let keys: i64 = sqlx::query_scalar(
        "with forgotten as (
             delete from inbox_key_positions
              where (endpoint, key) in (select endpoint, key from inbox_key_positions
                                         where moved_at < now() - $1 * interval '1 millisecond' limit $2)
                and moved_at < now() - $1 * interval '1 millisecond'
             returning endpoint, key
         ), places as (
             delete from inbox_key_given_up g using forgotten f where g.endpoint = f.endpoint and g.key = f.key
         )
         select count(*) from forgotten",
    )
    .bind(millis(retention))
    .bind(batch)
    .fetch_one(pool)
    .await?;
    Ok(most.max(u64::try_from(keys).unwrap_or(0)))
}
