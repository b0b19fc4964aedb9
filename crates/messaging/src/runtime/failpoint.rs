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
//!
//! A test learns that a point was reached from `FAILPOINTS_REPORT`, a file to which every hit of
//! an armed point appends the point's name on a line of its own ([`hits`] counts them), not from
//! the log line, whose wording is for people.

use std::{
    io::Write,
    path::Path,
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
            report(name);
            std::future::pending::<()>().await;
        }
        Some(Action::Pause(pause)) => {
            eprintln!("FAILPOINT {name} pausing");
            report(name);
            tokio::time::sleep(pause).await;
        }
        _ => {}
    }
}

/// Append `name` to the `FAILPOINTS_REPORT` file, if one is named. A report that cannot be written
/// panics (in the task that reached the point, with the reason in the log): a test timing out on a
/// report that never came would be chasing the wrong fault.
fn report(name: &str) {
    let Some(path) = std::env::var_os("FAILPOINTS_REPORT") else { return };
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut file| file.write_all(format!("{name}\n").as_bytes()));
    if let Err(error) = appended {
        panic!("FAILPOINTS_REPORT {}: {error}", path.to_string_lossy());
    }
}

/// How many times the point `name` was reached (or paused at), as the process with
/// `FAILPOINTS_REPORT=report` wrote them; 0 before the file exists.
pub fn hits(report: &Path, name: &str) -> usize {
    std::fs::read_to_string(report).map_or(0, |text| text.lines().filter(|line| *line == name).count())
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

    #[test]
    fn hits_count_one_point_by_its_whole_name() {
        let report = std::env::temp_dir().join(format!("failpoints-{}", std::process::id()));
        assert_eq!(hits(&report, WORKER_AFTER_COMMIT), 0, "no file yet");
        std::fs::write(&report, "worker.after-commit\nworker.after-commit-2\nworker.after-commit\n").expect("write");
        assert_eq!(hits(&report, WORKER_AFTER_COMMIT), 2);
        assert_eq!(hits(&report, RELAY_AFTER_CONFIRM), 0);
        std::fs::remove_file(&report).expect("remove");
    }
}
