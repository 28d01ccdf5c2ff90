//! Delay tiers: how a task waits for its `not_before` time or its next retry *in the broker*.
//!
//! Each tier is a durable queue whose messages all share one TTL (so expiry at the head is
//! exact, FIFO) and dead-letter into `<ns>.delayed`, which the scheduler consumes. A task due
//! in `d` goes to the largest tier not past `d`; when it comes back early the scheduler sends
//! it on another hop. Tiers are powers of two from 100 ms (100 ms … ~29 h), so any delay takes
//! at most a few dozen hops and lands within 100 ms of its time. Nothing waits in Redis or in
//! process memory, so losing either loses no delayed task.

use std::time::Duration;

/// Shortest tier.
pub const BASE_MS: u64 = 100;
/// Number of tiers: 100 ms × 2^0 … 2^20.
pub const TIERS: u32 = 21;

/// All tier lengths in milliseconds, shortest first.
pub fn tiers() -> impl Iterator<Item = u64> {
    (0..TIERS).map(|i| BASE_MS << i)
}

/// The tier for a remaining delay: the largest not past it; the shortest tier when less than
/// that remains (never early, at most 100 ms late); `None` when it is due.
pub fn tier_for(remaining: Duration) -> Option<u64> {
    let ms = u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX);
    if remaining.is_zero() {
        return None;
    }
    tiers().take_while(|t| *t <= ms).last().or(Some(BASE_MS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_largest_tier_not_past_due() {
        assert_eq!(tier_for(Duration::ZERO), None);
        assert_eq!(tier_for(Duration::from_millis(50)), Some(100));
        assert_eq!(tier_for(Duration::from_micros(10)), Some(100));
        assert_eq!(tier_for(Duration::from_millis(100)), Some(100));
        assert_eq!(tier_for(Duration::from_millis(399)), Some(200));
        assert_eq!(tier_for(Duration::from_secs(1)), Some(800));
        assert_eq!(tier_for(Duration::from_secs(100 * 3600)), Some(100 << 20));
    }
}
