//! Retention: rows that only matter for a while (published outbox rows, inbox rows, stale crash
//! counts) are deleted once they are older than their retention, in small batches so that no long
//! lock is held, at start-up and then hourly.

use std::{future::Future, time::Duration};

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
pub(crate) async fn delete_each(
    pool: &sqlx::PgPool,
    statements: &[&'static str],
    retention: Duration,
    batch: i64,
) -> sqlx::Result<u64> {
    let mut most = 0;
    for statement in statements {
        let deleted = sqlx::query(*statement).bind(millis(retention)).bind(batch).execute(pool).await?.rows_affected();
        most = most.max(deleted);
    }
    Ok(most)
}

/// `retention` as a Postgres interval parameter, in milliseconds.
pub(crate) fn millis(retention: Duration) -> i64 {
    i64::try_from(retention.as_millis()).unwrap_or(i64::MAX)
}
