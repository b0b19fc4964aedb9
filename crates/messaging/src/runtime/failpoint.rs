//! Test-only failpoints: named places where a crash is most dangerous, so the fault-injection
//! suite can `kill -9` (or SIGTERM) a real process exactly there.
//!
//! `FAILPOINTS` is a comma-separated list of armed points:
//! - `name`: the first time the point is reached, print `FAILPOINT <name> reached` on stderr and
//!   freeze the task that reached it, for the test to `kill -9` the process;
//! - `name=<duration>` (e.g. `worker.after-commit=300ms`): print `FAILPOINT <name> pausing` and
//!   pause there every time, which widens a window (say, committed but not yet acked) so a signal
//!   or a fault lands in it.
//!
//! Nothing is armed unless the variable is set; an unarmed point costs one lookup in an empty list.
//! The points below are messaging's own; a service names its own points the same way.

use std::{
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

/// The relay has its batch's confirms but has not marked the rows published.
pub const RELAY_AFTER_CONFIRM: &str = "relay.after-confirm";
/// A consumer has committed its transaction but not acked the delivery.
pub const WORKER_AFTER_COMMIT: &str = "worker.after-commit";
/// A consumer's handler has run but the transaction is not committed.
pub const WORKER_BEFORE_COMMIT: &str = "worker.before-commit";

/// What an armed point does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Freeze,
    Pause(Duration),
}

fn armed() -> &'static [(String, Action)] {
    static ARMED: OnceLock<Vec<(String, Action)>> = OnceLock::new();
    ARMED.get_or_init(|| parse(&std::env::var("FAILPOINTS").unwrap_or_default()))
}

fn parse(spec: &str) -> Vec<(String, Action)> {
    spec.split(',')
        .map(str::trim)
        .filter(|point| !point.is_empty())
        .map(|point| match point.split_once('=') {
            Some((name, pause)) => {
                let pause = crate::runtime::duration::parse_duration(pause)
                    .unwrap_or_else(|error| panic!("FAILPOINTS: bad pause for {name}: {error}"));
                (name.to_owned(), Action::Pause(pause))
            }
            None => (point.to_owned(), Action::Freeze),
        })
        .collect()
}

/// Do what the point `name` is armed to do, if anything.
pub async fn hit(name: &str) {
    static FROZE: AtomicBool = AtomicBool::new(false);
    match armed().iter().find(|(armed, _)| armed == name).map(|(_, action)| *action) {
        Some(Action::Freeze) if !FROZE.swap(true, Ordering::SeqCst) => {
            eprintln!("FAILPOINT {name} reached");
            std::future::pending::<()>().await;
        }
        Some(Action::Pause(pause)) => {
            eprintln!("FAILPOINT {name} pausing");
            tokio::time::sleep(pause).await;
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_freezes_and_pauses() {
        assert_eq!(
            parse(" relay.after-confirm, worker.after-commit=300ms ,"),
            vec![
                ("relay.after-confirm".to_owned(), Action::Freeze),
                ("worker.after-commit".to_owned(), Action::Pause(Duration::from_millis(300))),
            ]
        );
        assert!(parse("").is_empty());
    }
}
