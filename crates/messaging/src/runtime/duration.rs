//! Durations as `RETRY_DELAYS`, the other flags and queue names spell them: `250ms`, `5s`, `2m`,
//! `1h` (and `14d` for retention). A leaf module: everything else may use it.

use std::time::Duration;

pub use messaging_core::endpoint::format_duration;

/// Parse `250ms`, `5s`, `2m`, `1h` or `14d`. Zero is refused: a zero-TTL wait queue is a hot loop, and a
/// zero timeout fails everything.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let value: u64 = number.parse().map_err(|_| format!("`{s}` is not a duration such as 500ms, 5s, 2m or 1h"))?;
    let duration = match unit {
        "ms" => Duration::from_millis(value),
        "s" => Duration::from_secs(value),
        "m" => Duration::from_secs(value * 60),
        "h" => Duration::from_secs(value * 3600),
        "d" => Duration::from_secs(value * 86_400),
        _ => return Err(format!("`{s}` has no unit: use ms, s, m, h or d")),
    };
    if duration.is_zero() {
        return Err(format!("`{s}`: must be greater than zero"));
    }
    Ok(duration)
}

/// A duration for people, in whole units from days to milliseconds: `1d 2m 36s`.
pub fn describe(duration: Duration) -> String {
    let ms = duration.as_millis();
    let units = [(86_400_000, "d"), (3_600_000, "h"), (60_000, "m"), (1_000, "s"), (1, "ms")];
    let mut rest = ms;
    let mut parts = Vec::new();
    for (size, unit) in units {
        if rest >= size {
            parts.push(format!("{}{unit}", rest / size));
            rest %= size;
        }
    }
    if parts.is_empty() { "0s".to_owned() } else { parts.join(" ") }
}
