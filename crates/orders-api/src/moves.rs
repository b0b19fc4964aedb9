//! The moves a job's state may make, in one table ([`MOVES`]), and the count of every other move
//! as production writes it (issue 60).
//!
//! The table is the one source; each other copy is checked against it:
//! - **the code**: each statement of [`crate::jobs`] makes one or more of these moves, guarded in
//!   SQL (`state <> all($n)`, `state = $n`); [`allowed`] is the pure function of the table;
//! - **the model**: `docs/model/job_moves.pml` is generated from it ([`promela`]; a test fails
//!   while the file differs, `UPDATE_MODEL=1` rewrites it), and `docs/model/jobs.pml` asserts that
//!   every move it makes is one of them;
//! - **the database**: migration 0014's `job_move_allowed(from, to)` lists the same moves (a test
//!   in `testkit/tests/status.rs` compares it with [`allowed`] for every pair of states), and a
//!   trigger on `jobs` counts each move outside them into `job_moves_forbidden`, in the moving
//!   transaction, whoever writes it: this service, the relay's outbox trigger, an operator by
//!   hand. [`start`] exports those counts as `job_moves_forbidden_total{from,to}` (alert
//!   `JobMoveForbidden`), and the chaos soaks require none.

use std::{collections::HashMap, sync::atomic::Ordering, time::Duration};

use messaging::runtime::{metrics::Metrics, shutdown::Shutdown};
use prometheus_client::metrics::{counter::Counter, family::Family};
use sqlx::PgPool;

use crate::jobs::JobState::{self, *};

/// Every move of a job's state that the orders service makes, with what makes it. Staying in a
/// state (a second retry of the same step) is no move.
pub const MOVES: [(JobState, JobState, &str); 22] = [
    (Queued, Published, "the broker confirmed order.placed (the outbox trigger), or a step's result came first"),
    (Queued, RetryWait, "a step's retry, before the confirm was marked"),
    (Published, RetryWait, "a step's retry (jobs::retry_scheduled)"),
    (RetryWait, Published, "the step that was retried succeeded (jobs::step_succeeded)"),
    (Queued, Quarantined, "a step's message was parked (jobs::quarantined)"),
    (Published, Quarantined, "a step's message was parked"),
    (RetryWait, Quarantined, "a step's message was parked"),
    (Quarantined, Published, "an operator redrove the parked message (jobs::redriven)"),
    (Queued, Rejected, "inventory refused the order (jobs::rejected)"),
    (Published, Rejected, "inventory refused the order"),
    (RetryWait, Rejected, "inventory refused the order"),
    (Quarantined, Rejected, "inventory's refusal came after all"),
    (Queued, Succeeded, "invoice.created (jobs::decide)"),
    (Published, Succeeded, "invoice.created"),
    (RetryWait, Succeeded, "invoice.created"),
    (Quarantined, Succeeded, "invoice.created came after all (a copy parked after its commit)"),
    (Queued, Compensating, "a cancel, the deadline or job.abandoned before the broker confirmed (jobs::decide)"),
    (Published, Compensating, "payment.declined, a cancel, the deadline or job.abandoned"),
    (RetryWait, Compensating, "payment.declined, a cancel, the deadline or job.abandoned"),
    (Quarantined, Compensating, "payment.declined, a cancel, the deadline or job.abandoned after all"),
    (Compensating, Declined, "inventory.released and invoice.voided both in (jobs::compensated)"),
    (Compensating, Cancelled, "inventory.released and invoice.voided both in"),
];

/// Whether a job may move `from` → `to` (staying put is no move, and allowed).
pub fn allowed(from: JobState, to: JobState) -> bool {
    from == to || MOVES.iter().any(|&(f, t, _)| (f, t) == (from, to))
}

/// Every move [`allowed`] allows, `(from, to)`, in the order of [`JobState::ALL`].
pub fn all() -> Vec<(JobState, JobState)> {
    let states = JobState::ALL;
    states
        .iter()
        .flat_map(|&from| states.iter().map(move |&to| (from, to)))
        .filter(|&(from, to)| from != to && allowed(from, to))
        .collect()
}

/// `docs/model/job_moves.pml`: the table as a Promela macro, `JOB_MOVE(f, t)`, true when a job
/// may move from `f` to `t`.
pub fn promela() -> String {
    let mut text = String::from(
        "/* Generated from orders-api's moves.rs (moves::MOVES) by\n\
         \x20*   UPDATE_MODEL=1 cargo test -p orders-api moves\n\
         \x20* and checked by that test: do not edit. Every move of a job's state the code makes;\n\
         \x20* jobs.pml asserts that each of its own is one of them. */\n\
         #define JOB_MOVE(f, t) ( \\\n",
    );
    for (from, to) in all() {
        text.push_str(&format!("    (f == {} && t == {}) || \\\n", from.as_str(), to.as_str()));
    }
    text.push_str("    false)\n");
    text
}

/// `job_moves_forbidden_total{from,to}`: the moves outside [`MOVES`] that table
/// `job_moves_forbidden` holds, as the database's trigger counted them. It mirrors the table, so
/// it holds across restarts and instances, a move made while no instance ran is seen, and an
/// operator who clears the rows once they are understood sets it back to 0 (a counter's reset).
#[derive(Debug, Clone, Default)]
pub struct ForbiddenMoves {
    counted: Family<Vec<(String, String)>, Counter>,
}

impl ForbiddenMoves {
    /// Register `job_moves_forbidden_total` beside the runtime's metrics.
    pub fn register(metrics: &mut Metrics) -> Self {
        let moves = Self::default();
        metrics.register(
            "job_moves_forbidden",
            "Moves of a job's state that the job model forbids (moves::MOVES), by the states moved from and to, \
             as table job_moves_forbidden holds them (the database's trigger counts them; cleared by hand)",
            moves.counted.clone(),
        );
        moves
    }

    /// Set every series to what the table holds (`rows`): each forbidden pair, and any pair the
    /// table names or named `before` (the last read), to its count, or 0. Returns the pairs whose
    /// count grew since `before`.
    fn mirror(
        &self,
        rows: &[(String, String, i64)],
        before: &HashMap<(String, String), i64>,
    ) -> Vec<(String, String, i64)> {
        let now: HashMap<(String, String), i64> =
            rows.iter().map(|(from, to, moves)| ((from.clone(), to.clone()), *moves)).collect();
        let forbidden = JobState::ALL.into_iter().flat_map(|from| {
            JobState::ALL
                .into_iter()
                .filter(move |&to| !allowed(from, to))
                .map(move |to| (from.as_str().to_owned(), to.as_str().to_owned()))
        });
        let mut pairs: Vec<(String, String)> =
            forbidden.chain(now.keys().cloned()).chain(before.keys().cloned()).collect();
        pairs.sort_unstable();
        pairs.dedup();
        let mut grew = Vec::new();
        for (from, to) in pairs {
            let moves = now.get(&(from.clone(), to.clone())).copied().unwrap_or(0);
            if moves > before.get(&(from.clone(), to.clone())).copied().unwrap_or(0) {
                grew.push((from.clone(), to.clone(), moves));
            }
            let counter = self.counted.get_or_create(&vec![("from".to_owned(), from), ("to".to_owned(), to)]);
            counter.inner().store(u64::try_from(moves).unwrap_or(0), Ordering::Relaxed);
        }
        grew
    }
}

/// How often the table is read: a forbidden move is a bug or a hand edit, never a load.
pub const INTERVAL: Duration = Duration::from_secs(15);

/// Read `job_moves_forbidden` every [`INTERVAL`] until `shutdown` into `job_moves_forbidden_total`
/// ([`ForbiddenMoves`]), logging each move counted since the last read (at the first, what the
/// table holds already, once).
pub fn start(pool: PgPool, metrics: ForbiddenMoves, shutdown: Shutdown) {
    tokio::spawn(async move {
        let mut seen: Option<HashMap<(String, String), i64>> = None;
        let mut failing = false;
        let mut ticks = tokio::time::interval(INTERVAL);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = shutdown.triggered() => return,
            }
            let read = sqlx::query_as::<_, (String, String, i64)>(
                "select from_state, to_state, moves from job_moves_forbidden",
            )
            .fetch_all(&pool);
            match tokio::time::timeout(Duration::from_secs(10), read).await {
                Ok(Ok(rows)) => {
                    failing = false;
                    let grew = metrics.mirror(&rows, seen.as_ref().unwrap_or(&HashMap::new()));
                    if seen.is_none() && !grew.is_empty() {
                        let moves: i64 = grew.iter().map(|(_, _, moves)| moves).sum();
                        tracing::warn!(
                            moves,
                            "table job_moves_forbidden holds moves the job model forbids: see JobMoveForbidden"
                        );
                    } else {
                        for (from, to, moves) in &grew {
                            tracing::error!(%from, %to, moves, "a job moved as the job model forbids (job_moves_forbidden)");
                        }
                    }
                    seen = Some(rows.into_iter().map(|(from, to, moves)| ((from, to), moves)).collect());
                }
                // Logged once per outage: the database's own readiness check pages for it.
                outcome if !failing => {
                    failing = true;
                    let error = match outcome {
                        Ok(Err(error)) => error.to_string(),
                        _ => "no answer within 10 s".to_owned(),
                    };
                    tracing::warn!(%error, "cannot read the forbidden moves of jobs");
                }
                _ => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decided_job_moves_only_from_compensating_to_its_end() {
        for from in JobState::ALL {
            for to in JobState::ALL {
                if from == to {
                    assert!(allowed(from, to));
                    continue;
                }
                let expected = match (from, to) {
                    // An outcome never changes; compensating only takes its end.
                    (Succeeded | Rejected | Declined | Cancelled, _) => false,
                    (Compensating, to) => matches!(to, Declined | Cancelled),
                    // Declined and cancelled only through compensating.
                    (_, Declined | Cancelled) => false,
                    // Every undecided state may be decided.
                    (_, Succeeded | Rejected | Compensating) => true,
                    // A parked step holds the job: only a redrive moves it on, to published.
                    (Quarantined, to) => to == Published,
                    (_, Quarantined | RetryWait) => true,
                    (Published, Queued) | (RetryWait, Queued) => false,
                    (Queued | RetryWait, Published) => true,
                    (from, to) => panic!("unlisted {from:?} -> {to:?}"),
                };
                assert_eq!(allowed(from, to), expected, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn the_counter_mirrors_the_table_and_says_what_grew() {
        let metrics = ForbiddenMoves::default();
        let row = |from: &str, to: &str, moves| (from.to_owned(), to.to_owned(), moves);
        let series = |metrics: &ForbiddenMoves, from: &str, to: &str| {
            metrics.counted.get_or_create(&vec![("from".into(), from.into()), ("to".into(), to.into())]).get()
        };
        let grew = metrics.mirror(&[row("succeeded", "published", 2)], &HashMap::new());
        assert_eq!(grew, [row("succeeded", "published", 2)]);
        assert_eq!(series(&metrics, "succeeded", "published"), 2);
        assert_eq!(series(&metrics, "rejected", "queued"), 0, "every forbidden pair, at 0");
        let before = HashMap::from([(("succeeded".to_owned(), "published".to_owned()), 2)]);
        assert_eq!(metrics.mirror(&[row("succeeded", "published", 2)], &before), [], "nothing new");
        // Cleared by an operator: back to 0.
        assert_eq!(metrics.mirror(&[], &before), []);
        assert_eq!(series(&metrics, "succeeded", "published"), 0);
        // A row of a move an earlier release forbade and this one allows goes back to 0 too.
        let earlier = [row("queued", "published", 1)];
        metrics.mirror(&earlier, &HashMap::new());
        let before = HashMap::from([(("queued".to_owned(), "published".to_owned()), 1)]);
        metrics.mirror(&[], &before);
        assert_eq!(series(&metrics, "queued", "published"), 0);
    }

    #[test]
    fn the_model_s_table_of_moves_is_generated_from_this_one() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/model/job_moves.pml");
        let generated = promela();
        if std::env::var_os("UPDATE_MODEL").is_some() {
            std::fs::write(path, &generated).expect("write job_moves.pml");
        }
        let on_disk = std::fs::read_to_string(path).unwrap_or_default();
        assert!(on_disk == generated, "{path} is stale: run UPDATE_MODEL=1 cargo test -p orders-api moves");
    }
}
