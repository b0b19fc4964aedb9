/// What is known of a delivery when it arrives, read from its properties.
#[derive(Debug, Clone, Copy, Default)]
pub(in crate::consumer) struct Arrival {
    /// The broker's `redelivered` flag: it may be the message that crashed the last process.
    pub(in crate::consumer) redelivered: bool,
    /// Retries before this delivery.
    pub(in crate::consumer) retry_count: u32,
    /// Times it was sent back to wait for an earlier message of its key.
    pub(in crate::consumer) deferrals: u32,
    /// Its place among its key's messages, if it has one.
    pub(in crate::consumer) place: Option<i64>,
}
