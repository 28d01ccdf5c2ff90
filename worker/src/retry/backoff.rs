//! When: capped exponential backoff with full jitter (the algorithm is described in
//! [`crate::retry`]).

use std::time::Duration;

/// Backoff policy.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Backoff { base, cap }
    }

    /// The upper bound of the wait after failed attempt `attempt` (from 1):
    /// `min(cap, base × 2^(attempt−1))`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(40);
        let base_ms = u64::try_from(self.base.as_millis()).unwrap_or(u64::MAX);
        let ms = base_ms.saturating_mul(1u64 << exp);
        Duration::from_millis(ms).min(self.cap)
    }

    /// A wait drawn uniformly from `[0, ceiling(attempt)]`.
    pub fn delay(&self, attempt: u32) -> Duration {
        self.delay_with(attempt, rand::random::<f64>())
    }

    /// The wait for a given uniform sample `u` in `[0, 1)` (deterministic, for tests).
    pub fn delay_with(&self, attempt: u32, u: f64) -> Duration {
        self.ceiling(attempt).mul_f64(u.clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b() -> Backoff {
        Backoff::new(Duration::from_millis(1000), Duration::from_millis(600_000))
    }

    #[test]
    fn ceiling_doubles_then_caps() {
        let b = b();
        assert_eq!(b.ceiling(1), Duration::from_secs(1));
        assert_eq!(b.ceiling(2), Duration::from_secs(2));
        assert_eq!(b.ceiling(3), Duration::from_secs(4));
        assert_eq!(b.ceiling(10), Duration::from_secs(512));
        assert_eq!(b.ceiling(11), Duration::from_secs(600));
        assert_eq!(b.ceiling(1000), Duration::from_secs(600));
        assert_eq!(b.ceiling(0), Duration::from_secs(1));
        for n in 1..60 {
            assert!(b.ceiling(n) <= b.ceiling(n + 1));
        }
    }

    #[test]
    fn delays_stay_within_zero_and_the_ceiling() {
        let b = b();
        assert_eq!(b.delay_with(3, 0.0), Duration::ZERO);
        assert_eq!(b.delay_with(3, 0.5), Duration::from_secs(2));
        assert_eq!(b.delay_with(3, 1.0), Duration::from_secs(4));
        for attempt in 1..20 {
            let ceiling = b.ceiling(attempt);
            let samples: Vec<Duration> = (0..200).map(|_| b.delay(attempt)).collect();
            assert!(samples.iter().all(|d| *d <= ceiling), "attempt {attempt}");
            // Full jitter: spread over the whole interval, not clustered at the top.
            let below_half = samples.iter().filter(|d| **d < ceiling / 2).count();
            assert!(
                (40..=160).contains(&below_half),
                "attempt {attempt}: {below_half}/200 below half"
            );
        }
    }

    #[test]
    fn huge_bases_do_not_overflow() {
        let b = Backoff::new(
            Duration::from_secs(u64::MAX / 1000),
            Duration::from_secs(3600),
        );
        assert_eq!(b.ceiling(50), Duration::from_secs(3600));
    }
}
