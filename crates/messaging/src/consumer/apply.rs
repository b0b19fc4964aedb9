//! The transaction of one message, or of one batch: inbox row, handler, commit, all or nothing,
//! within the handler timeout.

use messaging_core::{
    envelope::{Incoming, Ordering},
    inbox, trace,
};
use sqlx::PgConnection;
use tracing::Instrument;
use uuid::Uuid;

use super::{
    Handler, HandlerError, Runtime,
    machine::Applied,
    ordering::{self, Turn},
    settle::Body,
};
use crate::runtime::{
    db::{self, Taken},
    duration::format_duration,
    failpoint,
    metrics::Handling,
};

impl<H: Handler> Runtime<H> {
    /// Inbox rows (one statement for the batch), handlers and one commit for the whole batch,
    /// within `handler_timeout`: all or nothing. Each handler runs in its message's span and trace
    /// context, so the outbox rows it writes continue that message's trace.
    pub(super) async fn apply_batch(&self, members: &[&Body]) -> Result<Vec<Applied>, HandlerError> {
        let all = async {
            let mut conn = self.kept.take().await?;
            // Given up at the deadline below, the connection is closed, not pooled (decision 0029).
            conn.close_on_drop();
            let applied = self.batch_transaction(&mut conn, members).await;
            conn.return_on_drop();
            if applied.is_ok() {
                self.kept.keep(conn);
            }
            applied
        };
        let limit = self.settings.handler_timeout;
        tokio::time::timeout(limit, all).await.unwrap_or_else(|_| {
            Err(HandlerError::Transient(format!("the batch did not finish within {}", format_duration(limit)).into()))
        })
    }

    /// [`Self::apply_batch`]'s transaction, on `conn`.
    async fn batch_transaction(&self, conn: &mut Taken, members: &[&Body]) -> Result<Vec<Applied>, HandlerError> {
        // The machine batches readable deliveries only.
        let readable: Vec<(&Body, &Incoming)> =
            members.iter().filter_map(|member| member.message().map(|message| (*member, message))).collect();
        if readable.len() != members.len() {
            return Err(HandlerError::Permanent("an unreadable delivery in a batch".into()));
        }
        let mut tx = conn.begin().await?;
        let messages: Vec<(Uuid, &str)> =
            readable.iter().map(|(_, message)| (message.message_id, message.message_type.as_str())).collect();
        let new = inbox::record_all(&mut tx, &messages, self.settings.endpoint.name).await?;
        let unseen: Vec<&Incoming> =
            readable.iter().zip(&new).filter(|(_, new)| **new).map(|((_, message), _)| *message).collect();
        self.handler.lock_batch(&unseen, &mut tx).await?;
        let mut outcomes = Vec::with_capacity(members.len());
        for ((member, message), new) in readable.iter().zip(new) {
            if !new {
                outcomes.push(Applied::Duplicate);
                continue;
            }
            if let Some(Turn::Waits { follows }) = self.take_turn(&mut tx, message).await? {
                // Nothing of the batch commits; one by one, this message goes back to wait.
                return Err(HandlerError::Transient(format!("a message waits for place {follows} of its key").into()));
            }
            let handled = self.handler.handle(message, &mut tx).instrument(member.made_span());
            trace::scope(member.context, handled).await?;
            outcomes.push(Applied::Done);
        }
        commit(tx).await?;
        Ok(outcomes)
    }

    /// The message's [`transaction`](Self::transaction) within `handler_timeout`, its duration
    /// recorded. An abandoned transaction rolls back with its connection; whose fault the wait
    /// was decides what it costs: a database that still takes writes makes it the message's
    /// (transient), one that does not an outage (no attempt spent).
    pub(super) async fn apply(&self, message: &Incoming) -> Result<Applied, HandlerError> {
        let started = std::time::Instant::now();
        let limit = self.settings.handler_timeout;
        let applied = match tokio::time::timeout(limit, self.transaction(message)).await {
            Ok(outcome) => outcome,
            Err(_) if db::takes_writes(&self.pool).await => Err(HandlerError::Transient(
                format!("the handler did not finish within {}", format_duration(limit)).into(),
            )),
            Err(_) => Err(HandlerError::Unavailable(
                format!("the database did not answer within {}", format_duration(limit)).into(),
            )),
        };
        let outcome = match &applied {
            Ok(applied) => applied.handling(),
            Err(HandlerError::Unavailable(_)) => Handling::Unavailable,
            Err(_) => Handling::Failed,
        };
        self.metrics.handling(outcome, started.elapsed().as_secs_f64());
        applied
    }

    /// Inbox row and turn, handler, commit: all or nothing. A message the inbox has seen changes
    /// nothing (`Duplicate`), nor does one that waits for its key's turn: its transaction rolls
    /// back.
    ///
    /// Its connection is kept for the next message's only if it commits. Otherwise it goes back to
    /// the pool, where sqlx's round trip on its return sends the rollback that dropping the
    /// transaction queued; or, given up mid-way, it is closed.
    async fn transaction(&self, message: &Incoming) -> Result<Applied, HandlerError> {
        let mut conn = self.kept.take().await?;
        // Given up at the handler's deadline, the connection is closed, not pooled (decision 0029).
        conn.close_on_drop();
        let applied = self.message_transaction(&mut conn, message).await;
        conn.return_on_drop();
        if matches!(applied, Ok(Applied::Done)) {
            self.kept.keep(conn);
        }
        applied
    }

    /// [`Self::transaction`]'s work, on `conn`. On an endpoint ordered by key, the inbox row and
    /// the turn are one statement.
    async fn message_transaction(&self, conn: &mut Taken, message: &Incoming) -> Result<Applied, HandlerError> {
        let mut tx = conn.begin().await?;
        let endpoint = &self.settings.endpoint;
        let turn = match self.keyed(message) {
            Some(ordering) => {
                let Some(turn) = ordering::record_and_take_turn(&mut tx, endpoint, message, ordering).await? else {
                    return Ok(Applied::Duplicate);
                };
                Some(turn)
            }
            None => {
                if !inbox::record(&mut tx, message.message_id, &message.message_type, endpoint.name).await? {
                    return Ok(Applied::Duplicate);
                }
                None
            }
        };
        if let Some(Turn::Waits { follows }) = turn {
            return Ok(Applied::Waits { follows });
        }
        self.handler.handle(message, &mut tx).await?;
        commit(tx).await?;
        Ok(Applied::Done)
    }

    /// On an endpoint ordered by key, the turn of a message that carries a key (`None` otherwise).
    async fn take_turn(&self, tx: &mut PgConnection, message: &Incoming) -> sqlx::Result<Option<Turn>> {
        match self.keyed(message) {
            Some(ordering) => ordering::take_turn(tx, &self.settings.endpoint, ordering).await.map(Some),
            None => Ok(None),
        }
    }

    /// The message's place among its key's, if it carries one and the endpoint is ordered by key.
    fn keyed<'m>(&self, message: &'m Incoming) -> Option<&'m Ordering> {
        message.ordering.as_ref().filter(|_| self.settings.endpoint.ordered_by_key)
    }
}

/// Commit a message's (or a batch's) transaction, between the workers' two failpoints.
async fn commit(tx: sqlx::Transaction<'_, sqlx::Postgres>) -> Result<(), HandlerError> {
    failpoint::hit(failpoint::WORKER_BEFORE_COMMIT).await;
    tx.commit().await?;
    failpoint::hit(failpoint::WORKER_AFTER_COMMIT).await;
    Ok(())
}

impl Applied {
    /// How its transaction ended, for `message_handling_duration_seconds`.
    pub(super) fn handling(self) -> Handling {
        match self {
            Self::Done => Handling::Succeeded,
            Self::Duplicate => Handling::Duplicate,
            Self::Waits { .. } => Handling::Deferred,
        }
    }
}
