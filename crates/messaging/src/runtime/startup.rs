//! Why a binary cannot start ([`StartupError`]): made where a server refuses us (TLS, credentials,
//! grants, migrations), reported by `service::exit`. Apart from the service runtime, so that what
//! is below it (the database and broker start-up) does not import it.

use std::fmt;

/// A reason a binary cannot start that no wait would cure: a certificate that does not verify,
/// bad credentials, a missing grant, a bad migration. The message names the server and what is
/// wrong, in one line; [`crate::service::exit`] prints it and ends the process with status 2,
/// before anything was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupError(pub String);

impl fmt::Display for StartupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartupError {}
