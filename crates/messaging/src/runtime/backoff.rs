//! Capped, jittered exponential backoff: how long to wait before reconnecting or retrying a publish.

use std::time::Duration;

/// Exponential backoff between `initial` and `max`, with jitter so that many clients that lost the
/// same server do not all come back in the same millisecond.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Delay before the first retry.
    pub initial: Duration,
    /// Upper bound of any delay.
    pub max: Duration,
}

impl Backoff {
    /// A backoff from `initial`, doubling up to `max`.
    pub const fn new(initial: Duration, max: Duration) -> Self {
        Self { initial, max }
    }

    /// The delay before retry number `failures` (0 for the first retry): `initial * 2^failures`
    /// capped at `max`, then drawn uniformly from its upper half ("equal jitter"), so a delay never
    /// collapses to zero yet two clients rarely collide.
    pub fn delay(&self, failures: u32) -> Duration {
        self.delay_drawn(failures, fastrand::f64())
    }

    /// [`Self::delay`] with its jitter given: `draw`, in `[0, 1]`, picks the point in the upper
    /// half (0 its bottom, 1 its top). What is decided free of I/O draws through this, so that a
    /// test can fix the draw and know every wait exactly.
    pub fn delay_drawn(&self, failures: u32, draw: f64) -> Duration {
        let factor = 1u32.checked_shl(failures.min(20)).unwrap_or(u32::MAX);
        let capped = self.initial.saturating_mul(factor).min(self.max);
        let half = capped / 2;
        half + half.mul_f64(draw.clamp(0.0, 1.0))
    }
}

impl Default for Backoff {
    /// 100 ms doubling to 10 s: quick after a blip, gentle on a server that stays down.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(10))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_grows_and_stays_within_bounds() {
        let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        for failures in 0..40 {
            let nominal =
                (Duration::from_millis(100) * 2u32.saturating_pow(failures.min(20))).min(Duration::from_secs(2));
            let delay = backoff.delay(failures);
            assert!(delay >= nominal / 2 && delay <= nominal, "{failures}: {delay:?}");
            assert_eq!(backoff.delay_drawn(failures, 0.0), nominal / 2);
            assert_eq!(backoff.delay_drawn(failures, 1.0), nominal);
        }
    }
}
