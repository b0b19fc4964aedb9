//! What `msgctl` does with parked messages, as a library: the command line (`msgctl parked …`)
//! and the live page's console (`orders-api`, `/parked`) run this one implementation, so that a
//! message is listed, judged against its consumer's inbox, redriven, abandoned or purged the same
//! way from either (issue 57).
//!
//! Nothing is lost if the caller dies at any point: parked messages are read unacked and only the
//! ones dealt with are acked, after the broker confirmed their copy or their job's event; the rest
//! go back to parking in their order when the command ends, or when its connection dies.

pub mod parked;

/// Why a command failed, reported as one line.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// In this tool's words, naming the server, endpoint or message it concerns.
    #[error("{0}")]
    Described(String),
    /// The command selected no message (none matches, or none is parked any more).
    #[error("{0}")]
    NothingSelected(String),
    /// The broker refused or dropped a call.
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    /// A database call failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// An event could not be encoded.
    #[error("cannot encode: {0}")]
    Encode(#[from] serde_json::Error),
}
