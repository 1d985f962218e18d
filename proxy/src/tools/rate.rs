//! The tool's rate limits: a token bucket per sandbox and side (callers
//! inside the sandbox cannot spend the outside harness's calls),
//! `per_minute` calls in any minute at most (full at start), 0 =
//! unlimited; and how often a refusal is recorded.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A sandbox's limits.
#[derive(Debug)]
pub(crate) struct ToolLimits {
    inside: RateLimit,
    outside: RateLimit,
    /// When a refusal was last recorded, and those not recorded since.
    refusals: Mutex<(Option<Instant>, u64)>,
}

impl ToolLimits {
    /// At most `per_minute` calls a minute from each side; 0: no limit.
    pub(crate) fn new(per_minute: u32) -> Self {
        ToolLimits {
            inside: RateLimit::new(per_minute),
            outside: RateLimit::new(per_minute),
            refusals: Mutex::new((None, 0)),
        }
    }

    /// Takes a call's token from its side's bucket.
    pub(crate) fn take(&self, inside: bool) -> Result<(), Duration> {
        match inside {
            true => self.inside.try_take(),
            false => self.outside.try_take(),
        }
    }

    /// Whether to record a call (`refused`: by the rate limit): Some with
    /// the refusals not recorded before it, or None (counted instead; at
    /// most one refusal a minute is recorded).
    pub(crate) fn record(&self, refused: bool) -> Option<u64> {
        self.record_at(refused, Instant::now())
    }

    fn record_at(&self, refused: bool, now: Instant) -> Option<u64> {
        let mut r = self.refusals.lock();
        let recent =
            r.0.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(60));
        if refused && recent {
            r.1 += 1;
            return None;
        }
        if refused {
            r.0 = Some(now);
        }
        Some(std::mem::take(&mut r.1))
    }
}

/// A token bucket.
#[derive(Debug)]
pub(crate) struct RateLimit {
    per_minute: u32,
    bucket: Mutex<(f64, Instant)>,
}

impl RateLimit {
    /// At most `per_minute` calls a minute; 0: no limit.
    pub(crate) fn new(per_minute: u32) -> Self {
        RateLimit {
            per_minute,
            bucket: Mutex::new((f64::from(per_minute), Instant::now())),
        }
    }

    /// Takes a call's token, or says how long until one is there.
    pub(crate) fn try_take(&self) -> Result<(), Duration> {
        self.take_at(Instant::now())
    }

    fn take_at(&self, now: Instant) -> Result<(), Duration> {
        if self.per_minute == 0 {
            return Ok(());
        }
        let rate = f64::from(self.per_minute) / 60.0;
        let mut b = self.bucket.lock();
        let (tokens, last) = *b;
        let tokens = (tokens + now.saturating_duration_since(last).as_secs_f64() * rate)
            .min(f64::from(self.per_minute));
        if tokens >= 1.0 {
            *b = (tokens - 1.0, now);
            Ok(())
        } else {
            *b = (tokens, now);
            Err(Duration::from_secs_f64((1.0 - tokens) / rate))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_one_per_interval() {
        let limit = RateLimit::new(2);
        let t0 = Instant::now();
        assert!(limit.take_at(t0).is_ok());
        assert!(limit.take_at(t0).is_ok());
        let wait = limit.take_at(t0).unwrap_err();
        assert!(
            wait > Duration::from_secs(29) && wait <= Duration::from_secs(30),
            "{wait:?}"
        );
        assert!(limit.take_at(t0 + Duration::from_secs(31)).is_ok());
        assert!(limit.take_at(t0 + Duration::from_secs(31)).is_err());
    }

    #[test]
    fn a_run_of_refusals_is_one_record_a_minute() {
        let limits = ToolLimits::new(1);
        let t0 = Instant::now();
        assert_eq!(limits.record_at(true, t0), Some(0));
        assert_eq!(limits.record_at(true, t0 + Duration::from_secs(1)), None);
        assert_eq!(limits.record_at(true, t0 + Duration::from_secs(2)), None);
        assert_eq!(limits.record_at(false, t0 + Duration::from_secs(3)), Some(2));
        assert_eq!(limits.record_at(true, t0 + Duration::from_secs(61)), Some(0));
        // The sides are apart.
        assert!(limits.take(true).is_ok());
        assert!(limits.take(true).is_err());
        assert!(limits.take(false).is_ok());
    }

    #[test]
    fn zero_is_unlimited() {
        let limit = RateLimit::new(0);
        for _ in 0..1000 {
            assert!(limit.try_take().is_ok());
        }
    }
}
