//! A consuming endpoint's settings, as flags with environment fallbacks: its retry tiers and
//! attempt cap, what it takes at once, the crash bound, and how long its inbox keeps a record.

use std::time::Duration;

use crate::{
    runtime::{
        config::{RetryDelays, parse_wait},
        duration::{describe, format_duration, parse_duration},
    },
    topology::{DEFAULT_DELIVERY_LIMIT, RetryPolicy},
};

/// Added to the retry horizon to get the shortest inbox retention a consumer accepts. A copy of
/// a message can arrive later than its last retry: the relay republishes a row that was confirmed
/// but not marked when its session ended (a relay, broker or database outage), and a consumer
/// takes back a delivery it held through a database outage. A day covers outages that long;
/// redrives from parking, which can come any time later, are guarded by `msgctl` itself.
pub const LATE_COPY_MARGIN: Duration = Duration::from_secs(24 * 3600);

/// How a consuming endpoint retries and how many deliveries it takes at once.
#[derive(Debug, Clone, clap::Args)]
pub struct ConsumerArgs {
    /// Delays of the retry tiers, in order (units ms, s, m, h). Attempt n+1 waits in tier n; past
    /// the last tier, the last delay repeats.
    #[arg(long, env = "RETRY_DELAYS", default_value = "1s,5s,30s,2m,10m")]
    pub retry_delays: RetryDelays,

    /// Attempts before a message that keeps failing is parked (1 = no retry).
    #[arg(long, env = "MAX_ATTEMPTS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_attempts: u32,

    /// Unacknowledged deliveries per consumer. With batching, twice BATCH_SIZE lets the next batch
    /// gather while one is applied; without (BATCH_SIZE=1), it is also how many deliveries are
    /// handled at once (16 was the fastest of 8 to 64 in `just bench` then).
    #[arg(long, env = "PREFETCH", default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..))]
    pub prefetch: u16,

    /// Deliveries applied in one transaction, at most (1 = each in its own, concurrently up to
    /// PREFETCH). Above 1, ready deliveries are applied in batches, one batch at a time, with one
    /// commit and one ack for the batch; a failure inside a batch applies its messages again one
    /// by one, so every outcome is as without batching (decision 0008).
    #[arg(long, env = "BATCH_SIZE", default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..))]
    pub batch_size: u16,

    /// How long a batch that is not full may wait for more deliveries before it starts (0: it
    /// takes what is ready). Only with BATCH_SIZE above 1.
    #[arg(long, env = "BATCH_WAIT", default_value = "0", value_parser = parse_wait)]
    pub batch_wait: Duration,

    /// Times a redelivered message may crash its consumer (start alone and never finish: the
    /// process killed, panicked or hung) before it is parked instead of handled again.
    #[arg(long, env = "MAX_CRASHES", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_crashes: u32,

    /// How long one message's transaction (inbox, handler, commit) may take before it is abandoned
    /// and rolled back: a transient failure if the database still answers, an outage if not. A
    /// batch gets as long; one that overruns is applied again message by message.
    #[arg(long, env = "HANDLER_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub handler_timeout: Duration,

    /// Returns of an unacked delivery before the broker itself dead-letters it: the last resort,
    /// far above the crash bound (decision 0005). Changing it on an existing work queue is refused
    /// by the broker (PRECONDITION_FAILED): see the decision for how to move a queue.
    #[arg(long, env = "DELIVERY_LIMIT", default_value_t = DEFAULT_DELIVERY_LIMIT,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub delivery_limit: u32,

    /// How long a processed message's inbox row (its protection against a second delivery) is
    /// kept. Must cover the retry horizon (the sum of the retry waits) plus a day for late copies;
    /// a shorter one is refused at start-up. Ordering keys that have not moved for as long are
    /// deleted too.
    #[arg(long, env = "INBOX_RETENTION", default_value = "14d", value_parser = parse_duration)]
    pub inbox_retention: Duration,

    /// How long the consumers may idle, nothing in flight, before their channels are closed and
    /// opened again: at least 1s, or 0 for never. A quorum queue can lose a delivery on its way
    /// to a consumer at a leader change and take it back only when the consumer's channel closes
    /// (rabbitmq-server#15473); the broker fetches it for a consumer that gets a later delivery,
    /// and an idle one gets it back this way (decision 0036).
    #[arg(long, env = "IDLE_RENEWAL", default_value = "60s", value_parser = parse_idle_renewal)]
    pub idle_renewal: Duration,
}

/// `IDLE_RENEWAL`: 0, or at least a second, since a shorter one would open channels all the time.
fn parse_idle_renewal(s: &str) -> Result<Duration, String> {
    let period = parse_wait(s)?;
    if !period.is_zero() && period < Duration::from_secs(1) {
        return Err(format!("`{s}` would open channels again all the time: use 1s or more, or 0 for never"));
    }
    Ok(period)
}

impl ConsumerArgs {
    /// The retry policy these flags describe.
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::new(self.retry_delays.0.clone(), self.max_attempts)
    }

    /// Every start-up check of these settings: [`check_inbox_retention`](Self::check_inbox_retention),
    /// then [`check_deferrals`](Self::check_deferrals).
    pub fn check(&self) -> Result<(), String> {
        self.check_inbox_retention()?;
        self.check_deferrals()
    }

    /// Refuse retry tiers under which a message that waits for an earlier one of its key (on an
    /// endpoint ordered by key) could be parked before that earlier one has used up its own
    /// attempts: a waiting message is sent back to the first tier at most 10,000 times (the
    /// consumer's `MAX_DEFERRALS`), so it waits at most that many first delays, and that must be
    /// at least twice the retry horizon (the earlier message's retries, and as long again for its
    /// publication and its trip through the queues). Otherwise, with
    /// `RETRY_DELAYS=10ms,30m`, an order's `order.ended` would be parked after 100 s while its
    /// `order.placed` still had an hour of retries ahead, and the order would stay `compensating`.
    pub fn check_deferrals(&self) -> Result<(), String> {
        let policy = self.retry_policy();
        let Some(&first) = policy.delays().first() else { return Ok(()) };
        let waits = first.saturating_mul(super::machine::MAX_DEFERRALS);
        let needed = policy.horizon().saturating_mul(2);
        if waits >= needed {
            return Ok(());
        }
        Err(format!(
            "RETRY_DELAYS={} with MAX_ATTEMPTS={}: a message waiting for an earlier one of its key would be parked \
             after {} ({} waits of the first tier, {}), less than the {} needed (twice the {} of retries the earlier \
             one may take): raise the first delay, or shorten the later ones or MAX_ATTEMPTS",
            policy.delays().iter().map(|delay| format_duration(*delay)).collect::<Vec<_>>().join(","),
            self.max_attempts,
            describe(waits),
            super::machine::MAX_DEFERRALS,
            describe(first),
            describe(needed),
            describe(policy.horizon()),
        ))
    }

    /// Refuse an inbox retention shorter than the latest a copy of a message can still arrive (the
    /// retry horizon plus [`LATE_COPY_MARGIN`]): such a copy would find no inbox row and be applied
    /// a second time. The message names both values.
    pub fn check_inbox_retention(&self) -> Result<(), String> {
        let retries = self.retry_policy().horizon();
        let needed = retries + LATE_COPY_MARGIN;
        if self.inbox_retention >= needed {
            return Ok(());
        }
        Err(format!(
            "INBOX_RETENTION={} is shorter than the {} a copy of a message can still arrive ({} of retry waits \
             for RETRY_DELAYS over MAX_ATTEMPTS={}, plus {} for late copies): a late copy would be applied twice",
            describe(self.inbox_retention),
            describe(needed),
            describe(retries),
            self.max_attempts,
            describe(LATE_COPY_MARGIN),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_renewal_is_0_or_at_least_a_second() {
        assert_eq!(parse_idle_renewal("0"), Ok(Duration::ZERO));
        assert_eq!(parse_idle_renewal("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_idle_renewal("60s"), Ok(Duration::from_secs(60)));
        assert!(parse_idle_renewal("999ms").is_err());
        assert!(parse_idle_renewal("soon").is_err());
    }

    #[test]
    fn an_inbox_retention_must_cover_the_retries_and_a_day() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            consumer: ConsumerArgs,
        }
        let parse = |args: &[&str]| Flags::parse_from([&["test"], args].concat()).consumer;
        // 1s + 5s + 30s + 2m between five attempts; the last wait (10m) is never taken.
        assert_eq!(parse(&[]).retry_policy().horizon(), Duration::from_secs(156));
        assert!(parse(&[]).check_inbox_retention().is_ok(), "the defaults fit");
        assert!(parse(&["--inbox-retention", "24h"]).check_inbox_retention().is_err());
        let refusal = parse(&["--inbox-retention", "1h"]).check_inbox_retention().expect_err("too short");
        assert!(refusal.starts_with("INBOX_RETENTION=1h is shorter than the 1d 2m 36s"), "{refusal}");
        let long_retries = ["--retry-delays", "1d", "--max-attempts", "20", "--inbox-retention", "14d"];
        assert!(parse(&long_retries).check_inbox_retention().is_err(), "19 days of retries need more");
    }

    #[test]
    fn a_message_waiting_its_turn_must_outlast_the_retries_of_the_one_it_waits_for() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            consumer: ConsumerArgs,
        }
        let parse = |args: &[&str]| Flags::parse_from([&["test"], args].concat()).consumer;
        assert!(parse(&[]).check().is_ok(), "the defaults: 2h 46m 40s of waits against 2m 36s of retries");
        assert!(parse(&["--retry-delays", "100ms,300ms"]).check_deferrals().is_ok(), "the test kit's");
        // 10,000 waits of 10 ms against 10 ms + 3 × 30 min of retries.
        let short = ["--retry-delays", "10ms,30m", "--inbox-retention", "30d"];
        let refusal = parse(&short).check().expect_err("parked after 100 s, retried for 90 min");
        assert!(refusal.starts_with("RETRY_DELAYS=10ms,30m with MAX_ATTEMPTS=5:"), "{refusal}");
        assert!(refusal.contains("after 1m 40s") && refusal.contains("the 3h 20ms needed"), "{refusal}");
        // Four attempts wait X + 30 s + 30 s; 10,000 × X must reach twice that: X ≥ 12.0024 ms.
        assert!(parse(&["--retry-delays", "13ms,30s", "--max-attempts", "4"]).check_deferrals().is_ok());
        assert!(parse(&["--retry-delays", "12ms,30s", "--max-attempts", "4"]).check_deferrals().is_err());
    }
}
