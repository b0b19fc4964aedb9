//! Test-only failpoints: named places where a crash is most dangerous, so the fault-injection
//! suite can `kill -9` (or SIGTERM) a real process exactly there.
//!
//! They exist only in a build with the feature `failpoints` (decision 0025), which the test kit
//! turns on, and with it every binary of a workspace build. A default build (`cargo build -p
//! relay`, the release image) ignores `FAILPOINTS`, warning once at start-up if it is set
//! ([`warn_if_ignored`]): a stray variable in production must not freeze a worker.
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

use std::path::Path;
#[cfg(any(feature = "failpoints", test))]
use std::time::Duration;
#[cfg(feature = "failpoints")]
use std::{
    io::Write,
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
};

/// The relay has its batch's confirms but has not marked the rows published.
pub const RELAY_AFTER_CONFIRM: &str = "relay.after-confirm";
/// A consumer has committed its transaction but not acked the delivery.
pub const WORKER_AFTER_COMMIT: &str = "worker.after-commit";
/// A consumer's handler has run but the transaction is not committed.
pub const WORKER_BEFORE_COMMIT: &str = "worker.before-commit";

/// What an armed point does.
#[cfg(any(feature = "failpoints", test))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Freeze,
    Pause(Duration),
}

#[cfg(feature = "failpoints")]
fn armed() -> &'static [(String, Action)] {
    static ARMED: OnceLock<Vec<(String, Action)>> = OnceLock::new();
    ARMED.get_or_init(|| parse(&std::env::var("FAILPOINTS").unwrap_or_default()))
}

#[cfg(any(feature = "failpoints", test))]
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

/// Do what the point `name` is armed to do, if anything: nothing in a build without the
/// feature `failpoints`.
pub async fn hit(name: &str) {
    #[cfg(feature = "failpoints")]
    armed_hit(name).await;
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}

/// Whether this build has the failpoints (the feature `failpoints`).
pub const COMPILED_IN: bool = cfg!(feature = "failpoints");

/// Whether `FAILPOINTS` is set in a build that ignores it.
pub fn ignored() -> bool {
    !COMPILED_IN && std::env::var_os("FAILPOINTS").is_some()
}

/// Warn, once at start-up, that `FAILPOINTS` is set in a build that ignores it ([`ignored`]).
pub fn warn_if_ignored() {
    if ignored() {
        tracing::warn!("FAILPOINTS is set, but this build has no failpoints (the feature `failpoints`): ignored");
    }
}

#[cfg(feature = "failpoints")]
async fn armed_hit(name: &str) {
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
#[cfg(feature = "failpoints")]
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
