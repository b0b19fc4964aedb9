//! Why a binary cannot start ([`StartupError`]): made where a server refuses us (TLS, credentials,
//! grants, migrations), reported by [`exit`] as the process ends.

use std::{fmt, process::ExitCode};

/// A reason a binary cannot start that no wait would cure: a certificate that does not verify,
/// bad credentials, a missing grant, a bad migration. The message names the server and what is
/// wrong, in one line; [`exit`] prints it and ends the process with status 2,
/// before anything was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupError(pub String);

impl fmt::Display for StartupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartupError {}

/// Any error a binary's `main` reports.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How a binary's `main` ends: success; a [`StartupError`] as `NAME: cannot start: REASON` on
/// one line and status 2 (as for a bad flag); any other error on one line and status 1.
pub fn exit(name: &str, outcome: Result<(), BoxError>) -> ExitCode {
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => match error.downcast_ref::<StartupError>() {
            Some(refusal) => {
                tracing::error!(reason = %refusal, "cannot start");
                eprintln!("{name}: cannot start: {refusal}");
                ExitCode::from(2)
            }
            None => {
                eprintln!("{name}: {error}");
                ExitCode::FAILURE
            }
        },
    }
}
