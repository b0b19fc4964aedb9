//! What a database error means to a writer: the database is not available to it (down, starting,
//! restarting, or a node that no longer takes writes), which is waited out and costs the work
//! nothing; or a verdict that a retry would repeat. Handlers, the consumer, the relay and the API
//! all classify their errors here, once.

use std::{
    error::Error as StdError,
    sync::{
        LazyLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use sqlx::migrate::MigrateError;

/// Whether an error means "the database is not available to us (yet)", worth waiting for: the
/// server is not there, or it is there and is not the primary ([`is_wrong_node`]). A TLS
/// handshake that fails is one too, unless it failed on a verdict about the certificates
/// ([`verification_failure`]): a connection that dies during the handshake (or
/// during the `SSLRequest` before it, which sqlx reports as an unexpected response) is an outage.
///
/// Every error the services meet is classified here, so this is also where a wrong node is acted
/// on: it [retires](retire_connections) the connections opened so far.
pub fn is_unreachable(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => {
            verification_failure(error).is_none()
        }
        sqlx::Error::Tls(_) => verification_failure(error).is_none(),
        sqlx::Error::Protocol(message) => message.starts_with("unexpected response from SSLRequest"),
        sqlx::Error::Database(_) if is_wrong_node(error) => {
            retire_connections();
            true
        }
        sqlx::Error::Database(e) => e.code().is_some_and(|code| cannot_now(&code)),
        // A connection lost while the migrations were checked or applied (each applies in a
        // transaction of its own, which the loss rolls back): start-up waits and tries again.
        sqlx::Error::Migrate(migrate) => match &**migrate {
            MigrateError::Execute(e) | MigrateError::ExecuteMigration(e, _) => is_unreachable(e),
            _ => false,
        },
        _ => false,
    }
}

/// Whether a statement failed because other work held what it needed, or the server gave up on
/// it: a serialization failure (40001) or a deadlock (40P01), a lock not granted within
/// `lock_timeout` (55P03), a statement cancelled at `statement_timeout` (57014). Its transaction
/// rolls back, so nothing was written, and the same work may succeed later. A consumer retries
/// such a message (a transient failure, spending an attempt); the API answers 503 with
/// `Retry-After`, as for a database it cannot reach, instead of a 500 that a client would not
/// retry (until 2026-12-07, a cancel behind a lock held past the timeout answered 500).
///
/// 57014 is in because it is what a lock wait ends in as often as 55P03 on a loaded server: CI's
/// container cell saw a cancel behind a held row cancelled at the 5 s `statement_timeout` before
/// its 3 s `lock_timeout` fired (the lock wait began late). A statement too slow for its own data
/// also ends there, on every try: its cause is logged with the 503, which `ApiErrorRate` counts
/// as it counts a 500. Not the rest of class 40 (40003, the commit's outcome unknown: something
/// may have been written).
pub fn lost_to_other_work(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(e) => {
            e.code().is_some_and(|code| matches!(&*code, "40001" | "40P01" | "55P03" | "57014"))
        }
        _ => false,
    }
}

/// Whether the same work may pass if tried again later, with nothing of this try written: the
/// database is not available ([`is_unreachable`]) or the statement lost to other work
/// ([`lost_to_other_work`]). What a request answers with 503 and a background step waits out.
pub fn retry_later(error: &sqlx::Error) -> bool {
    is_unreachable(error) || lost_to_other_work(error)
}

/// Whether SQLSTATE `code` says the server cannot do any work now, whatever the work: a state of
/// the server, not a verdict on the statement, so trying again later is all there is to do, and
/// no attempt of a message should be spent on it (decision 0003).
///
/// - class 08: connection trouble;
/// - 57P01–57P03 and 57P05: the session ended by the server shutting down (an administrator's, or
///   a failover's, `admin_shutdown`), crashing, starting up, or idling too long;
/// - class 53, insufficient resources: the disk full (53100), out of memory (53200), too many
///   connections (53300), or resources in general (53000). A disk that fills would otherwise
///   spend every message's attempts and park them all, undo messages included, while the API
///   answered 500; an outage instead holds them, costs nothing, and pages through
///   `consumer_deliveries_held` (alert `DeliveriesHeldByAnOutage`). Not 53400, a configured limit
///   the statement itself reached (`temp_file_limit`): the same statement reaches it again, so it
///   stays a transient failure, retried and then parked;
/// - 58000 and 58030: the server's own system or I/O error (a failing disk).
///
/// The price: a message whose own work exhausts memory (a transaction too large, or too many locks
/// for `max_locks_per_transaction`, both 53200) is held, not parked, until its endpoint's
/// held-deliveries alert is acted on.
pub fn cannot_now(code: &str) -> bool {
    code.starts_with("08")
        || matches!(code, "53000" | "53100" | "53200" | "53300")
        || matches!(code, "57P01" | "57P02" | "57P03" | "57P05" | "58000" | "58030")
}

/// Whether the server refused a write because it is not (or no longer) the primary: SQLSTATE
/// 25006, `read_only_sql_transaction`, from a hot standby, a demoted primary, or a session a
/// failover left read-only (`default_transaction_read_only`). The database is then unavailable to
/// a writer, exactly like one that is down: nothing is the message's or the request's fault.
///
/// What answered is still there, and may answer read-only for good (a standby behind a stale
/// address), so [`is_unreachable`] calls [`retire_connections`] on seeing it: every pool whose
/// connections are on such a node then reconnects, which resolves the address again, instead of
/// handing out the same read-only sessions.
pub fn is_wrong_node(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some("25006"))
}

/// When the last [`retire_connections`] happened, in milliseconds after [`ORIGIN`] (0: never).
static RETIRED_AT: AtomicU64 = AtomicU64::new(0);

/// The instant [`RETIRED_AT`] counts from: the first time either is used.
static ORIGIN: LazyLock<Instant> = LazyLock::new(Instant::now);

/// A node refused a write ([`is_wrong_node`]): every connection opened before now may be on such
/// a node. Each pool of this process (those made by `messaging::runtime::db::pool_options`) then
/// asks one of its connections opened before now whether it is on a node that takes writes, and
/// only if it is not, closes instead of handing out each of its connections opened before now; a
/// loop's kept connection asks for itself. So a read-only database in the relay's list retires the
/// connections to it, not those to the others (issue 56, row 4). An error does not say which
/// database it came from, which is why the pools ask: one round trip each per refusal.
pub fn retire_connections() {
    let now = u64::try_from(ORIGIN.elapsed().as_millis()).unwrap_or(u64::MAX).max(1);
    RETIRED_AT.fetch_max(now, Ordering::Relaxed);
}

/// The last [`retire_connections`], as a mark that only grows (0: none yet).
pub fn last_retirement() -> u64 {
    RETIRED_AT.load(Ordering::Relaxed)
}

/// Whether a connection opened `age` ago was opened before the retirement `mark`
/// ([`last_retirement`]).
pub fn opened_before(mark: u64, age: Duration) -> bool {
    match mark {
        0 => false,
        at => age > ORIGIN.elapsed().saturating_sub(Duration::from_millis(at)),
    }
}

/// The reason a TLS handshake failed, if `error` (or anything it wraps) is one that retrying
/// cannot cure: a certificate that does not verify (unknown issuer, expired, not valid for the
/// name), a TLS alert from the server (it refused our certificate), or TLS files that cannot be
/// read. `None` for everything else, which is worth retrying.
pub fn verification_failure(error: &(dyn StdError + 'static)) -> Option<String> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            // A verdict on the certificates or the parameters, which the next try would repeat;
            // not a handshake cut short or garbled by a failing connection.
            return matches!(
                tls,
                rustls::Error::InvalidCertificate(_)
                    | rustls::Error::AlertReceived(_)
                    | rustls::Error::NoCertificatesPresented
                    | rustls::Error::PeerIncompatible(_)
                    | rustls::Error::UnsupportedNameType
                    | rustls::Error::InvalidCertRevocationList(_)
            )
            .then(|| tls.to_string());
        }
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            if let Some(found) = io.get_ref().and_then(|inner| verification_failure(inner)) {
                return Some(found);
            }
            if let Some(unreadable) = io.get_ref().and_then(|inner| inner.downcast_ref::<UnreadableFile>()) {
                return Some(unreadable.to_string());
            }
        }
        next = error.source();
    }
    None
}

/// A TLS file named by a connection that cannot be read: the next try would fail the same way.
#[derive(Debug)]
pub struct UnreadableFile(pub String);

impl std::fmt::Display for UnreadableFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl StdError for UnreadableFile {}

#[cfg(test)]
mod tests {
    use super::{MigrateError, is_unreachable, last_retirement, opened_before, retire_connections};
    use std::time::Duration;

    #[test]
    fn a_connection_lost_while_migrating_is_an_outage_and_a_failed_migration_is_not() {
        let lost = || sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "peer closed connection"));
        let migrating = |error| sqlx::Error::Migrate(Box::new(MigrateError::Execute(error)));
        assert!(is_unreachable(&migrating(lost())), "lost while checking what is applied");
        let applying = sqlx::Error::Migrate(Box::new(MigrateError::ExecuteMigration(lost(), 106)));
        assert!(is_unreachable(&applying), "lost while applying one");
        let changed = sqlx::Error::Migrate(Box::new(MigrateError::VersionMismatch(106)));
        assert!(!is_unreachable(&changed), "a migration changed after it was applied: no wait cures it");
        assert!(!is_unreachable(&migrating(sqlx::Error::Protocol("garbled".into()))));
    }

    #[test]
    fn the_server_out_of_disk_memory_or_connections_is_an_outage_and_a_refused_statement_is_not() {
        use super::cannot_now;
        for code in ["08006", "57P01", "57P03", "57P05", "53000", "53100", "53200", "53300", "58030"] {
            assert!(cannot_now(code), "{code}");
        }
        // A conflict, a lock waited for, a statement timeout, a temp file limit: the message's own
        // work, retried. A constraint or a type: a verdict. 25006 is a wrong node, on its own.
        for code in ["40001", "40P01", "55P03", "57014", "53400", "23505", "22P02", "25006", "58P01", "XX000"] {
            assert!(!cannot_now(code), "{code}");
        }
    }

    #[test]
    fn connections_opened_before_a_retirement_are_suspect_and_later_ones_not() {
        retire_connections();
        let mark = last_retirement();
        assert!(mark > 0);
        assert!(opened_before(mark, Duration::from_secs(3600)), "opened an hour ago");
        std::thread::sleep(Duration::from_millis(20));
        assert!(!opened_before(mark, Duration::from_millis(5)), "opened after the retirement");
        assert!(!opened_before(0, Duration::from_secs(3600)), "no retirement yet");
    }
}
