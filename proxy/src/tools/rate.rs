//! The tool's rate limit: a token bucket per sandbox, `per_minute` calls
//! in any minute at most (full at start), 0 = unlimited.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

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
    fn zero_is_unlimited() {
        let limit = RateLimit::new(0);
        for _ in 0..1000 {
            assert!(limit.try_take().is_ok());
        }
    }
}
