//! Delay tiers: how a task waits for its `not_before` time or its next retry *in the broker*.
//!
//! Each tier is a durable queue (`<ns>.hold.<ms>`) of messages that all wait one length, so
//! they come due in queue order. A task due in `d` goes to the largest tier not past `d`, its
//! message stamped with the end of its hop ([`HOP_DUE`](crate::task::headers::HOP_DUE), fleet
//! clock); the scheduler's tier loops consume every tier, hold each message until its hop
//! ends, and forward it to `<ns>.delayed`, acking the tier's copy only once the forward is
//! confirmed. When it comes back early the scheduler sends it on another hop. Tiers are powers
//! of two from 100 ms to 819.2 s ([`TIERS`]), so any delay lands within 100 ms of its time;
//! a delay longer than the longest tier takes one hop of it per 13.6 min. Nothing waits in
//! Redis or in process memory only: a held message is the broker's until acked, so losing the
//! scheduler, Redis or a node loses no delayed task.
//!
//! Why not queue TTLs dead-lettering into `<ns>.delayed` (fleet's tiers until issue 37):
//! RabbitMQ's at-least-once dead-lettering hands expired messages to a dead-letter worker
//! process per quorum queue, which stalls when the target's leader moves (180 s by default,
//! and on 3.10.8 indefinitely when the tier's own leader moved: rabbitmq-server #7677,
//! #16203, #16652) — delayed work and retries sat in the tiers for minutes after a node loss,
//! invisible to queue depths. A consumer re-resolves leaders like any client, and what it
//! holds is counted as unacked. The longest tier stays well under RabbitMQ's
//! `consumer_timeout` (30 min by default), which closes a channel holding a delivery longer.

use std::time::Duration;

/// Shortest tier.
pub const BASE_MS: u64 = 100;
/// Number of tiers: 100 ms × 2^0 … 2^13 (819.2 s, the longest hold — under RabbitMQ's
/// default `consumer_timeout` of 30 min with room for a backlog).
pub const TIERS: u32 = 14;

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

/// The tier lengths of versions whose tiers expired messages by TTL (100 ms × 2^0 … 2^20):
/// what a namespace's clean-up deletes beside today's.
pub fn ttl_tiers() -> impl Iterator<Item = u64> {
    (0..21).map(|i| BASE_MS << i)
}

/// The longest tier, in milliseconds.
pub const LONGEST_MS: u64 = BASE_MS << (TIERS - 1);

/// The headers of a message entering `tier` at `now` (ms since the epoch, fleet clock): the
/// tier that routes it and the end of its hop.
pub fn hop(tier: u64, now_ms: i64) -> [(&'static str, String); 2] {
    let due = now_ms.saturating_add(i64::try_from(tier).unwrap_or(i64::MAX));
    [
        (crate::task::headers::TIER, tier.to_string()),
        (crate::task::headers::HOP_DUE, due.to_string()),
    ]
}

/// The end of a held message's hop (ms since the epoch) from its headers; `None` when it has
/// none (published by a version whose tiers expired messages themselves): forward it now, and
/// the scheduler sends it on another hop if it is early.
pub fn hop_due(props: &lapin::BasicProperties) -> Option<i64> {
    crate::broker::amqp::header_str(props, crate::task::headers::HOP_DUE)?
        .parse()
        .ok()
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
        assert_eq!(tier_for(Duration::from_secs(100 * 3600)), Some(LONGEST_MS));
        assert_eq!(LONGEST_MS, 819_200);
        assert_eq!(tiers().last(), Some(LONGEST_MS));
    }

    #[test]
    fn a_hop_ends_one_tier_after_it_starts() {
        let h = hop(800, 1_000_000);
        assert_eq!(h[0], (crate::task::headers::TIER, "800".to_string()));
        assert_eq!(h[1], (crate::task::headers::HOP_DUE, "1000800".to_string()));
        let props = lapin::BasicProperties::default().with_headers(crate::broker::amqp::headers(h));
        assert_eq!(hop_due(&props), Some(1_000_800));
        assert_eq!(hop_due(&lapin::BasicProperties::default()), None);
    }
}
