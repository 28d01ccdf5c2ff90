//! The tier loops: the scheduler holds every delay tier's messages until their hop ends and
//! forwards them to `<ns>.delayed` (see [`fleet::broker::delay`] for the layout and why fleet does
//! this itself rather than by queue TTL and dead-lettering; issue 37 item 1).
//!
//! One loop per tier per scheduler replica consumes `<ns>.hold.<ms>` with a prefetch of
//! [`PREFETCH`] and keeps what it holds ordered by due time (its
//! [`HOP_DUE`](fleet::task::headers::HOP_DUE), capped at one tier length from when it arrived): the
//! messages of a tier mostly come due in queue order, but not always — a replica that stops
//! hands its held messages back behind the ones this one holds, and publishers' clocks differ.
//! When the earliest is due, the loop publishes every due one to `<ns>.delayed` together and
//! acks each tier copy once its forward is confirmed (within [`CONFIRM_WAIT`]). A forward the
//! broker refuses or does not confirm (the target mid-election nacks) stays held, due again
//! [`REFUSED_PAUSE`] later — never requeued, so it keeps its place and spends no delivery
//! count — unless it has been held [`MAX_HOLD`], when it goes back to the tier (`nack`) before
//! RabbitMQ's `consumer_timeout` (30 min by default) would close the channel. A crash between
//! the confirm and the ack forwards a message twice, which the delayed path absorbs like any
//! redelivery (dedupe protocol, attempt records). Replicas compete for the messages like any
//! consumers; a replica that stops hands what it held back to the queue.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet::{broker::amqp, broker::delay, Names};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use crate::session::Session;

/// Deliveries a tier loop holds at once. A burst larger than this waits in the tier, each
/// message still due at its own hop's end (held ones are acked as they come due, which lets
/// the next in).
pub const PREFETCH: u16 = 512;
/// Most deliveries forwarded in one batch.
pub const BATCH_MAX: usize = 256;
/// How long a refused forward waits before it is tried again.
pub const REFUSED_PAUSE: Duration = Duration::from_millis(500);
/// How long a forward's confirm is awaited before it counts as refused.
pub const CONFIRM_WAIT: Duration = Duration::from_secs(10);
/// The longest a delivery is held: past it, a forward still refused hands it back to the tier.
/// The longest tier (819.2 s) plus room, under RabbitMQ's default `consumer_timeout` (30 min).
pub const MAX_HOLD: Duration = Duration::from_secs(20 * 60);

/// Holds and forwards one delay tier.
pub struct TierLoop {
    pub session: Arc<Session>,
    /// The tier's length (ms).
    pub tier: u64,
    /// The channel every tier loop of the session consumes on ([`channel`]).
    pub ch: lapin::Channel,
}

/// The one channel of a session's tier loops, each consumer on it held to [`PREFETCH`]
/// (`basic.qos` without `global` applies to each consumer). One channel for the fourteen
/// tiers rather than one each: lapin walks every channel of a connection for every frame it
/// writes (`Channels::flow`), and the session connection carries the hot path (BENCHMARKS.md
/// round 22). Each delivery is acked or nacked on its own (no `multiple`), so the loops
/// never settle one another's; a channel error ends every tier loop, and with them the
/// session, as one loop's did.
///
/// # Errors
/// The channel could not be opened or its prefetch set.
pub async fn channel(conn: &lapin::Connection) -> fleet::Result<lapin::Channel> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    Ok(ch)
}

/// How many tasks the session's tier loops hold, all tiers together (delay canaries not
/// counted).
#[derive(Debug, Default)]
pub struct HeldCount(std::sync::atomic::AtomicI64);

impl HeldCount {
    /// The deliveries held now.
    pub fn get(&self) -> u64 {
        u64::try_from(self.0.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(0)
    }

    fn add(&self, n: i64) {
        self.0.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One tier loop's share of a [`HeldCount`]: kept in step with its held map, and taken
/// back when the loop ends (its deliveries go back to the tier when the tier loops' channel
/// closes, with the session).
struct HeldShare<'a> {
    count: &'a HeldCount,
    mine: i64,
}

impl HeldShare<'_> {
    fn set(&mut self, n: usize) {
        let n = i64::try_from(n).unwrap_or(i64::MAX);
        self.count.add(n - self.mine);
        self.mine = n;
    }
}

impl Drop for HeldShare<'_> {
    fn drop(&mut self) {
        self.count.add(-self.mine);
    }
}

/// A held delivery.
struct Held {
    /// A delay canary, not a task.
    canary: bool,
    delivery: Delivery,
    /// When it came to this loop.
    since: Instant,
}

impl TierLoop {
    /// Runs until `shutdown` (`Ok`; what the loop held goes back to the tier when the tier
    /// loops' channel closes, with the session) or until the channel or the publisher fails
    /// (`Err`: the session restarts).
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let s = &self.session;
        let queue = s.names.delay_queue(self.tier);
        let mut consumer = self
            .ch
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::debug!(queue = %queue, "holding a delay tier");
        let (exchange, key) = (s.names.tasks_exchange(), Names::DELAYED_KEY);
        // Held deliveries by (due ms, arrival sequence).
        let mut held: BTreeMap<(i64, u64), Held> = BTreeMap::new();
        let mut share = HeldShare {
            count: &s.tiers_held,
            mine: 0,
        };
        let mut seq = 0u64;
        let mut refusing = false;
        loop {
            // Tasks only: the delay canaries ([`crate::canary`]) pass through too.
            share.set(held.values().filter(|h| !h.canary).count());
            let now = s.store.clock.now_ms();
            let wait = held
                .first_key_value()
                .map(|((due, _), _)| millis_until(*due, now));
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                d = consumer.next() => {
                    let d = match d {
                        Some(Ok(d)) => d,
                        Some(Err(e)) => return Err(e.into()),
                        None => return Err(fleet::Error::ConsumerEnded { queue: queue.to_string() }),
                    };
                    let due = due_at(delay::hop_due(&d.properties), now, self.tier);
                    seq += 1;
                    let canary = amqp::header_text(&d.properties, crate::canary::HEADER).is_some();
                    held.insert((due, seq), Held { delivery: d, since: Instant::now(), canary });
                    continue;
                }
                _ = tokio::time::sleep(wait.unwrap_or(Duration::ZERO)), if wait.is_some() => {}
            }
            // Every held delivery whose hop has ended, earliest first.
            let now = s.store.clock.now_ms();
            let mut batch = Vec::new();
            while batch.len() < BATCH_MAX {
                match held.first_entry() {
                    Some(e) if e.key().0 <= now => batch.push(e.remove()),
                    _ => break,
                }
            }
            if batch.is_empty() {
                continue;
            }
            let confirms = amqp::publish_batch(
                &s.publisher(),
                batch.iter().map(|h| amqp::Outgoing {
                    exchange: &exchange,
                    routing_key: key,
                    body: &h.delivery.data,
                    props: h.delivery.properties.clone(),
                }),
            )
            .await;
            let (mut refused, mut taken, mut nacked) = (0usize, 0usize, 0usize);
            for (h, c) in batch.into_iter().zip(confirms) {
                let ok = match c {
                    Ok(c) => match tokio::time::timeout(CONFIRM_WAIT, amqp::confirmed(c)).await {
                        Ok(r) => r,
                        Err(_) => Err(fleet::Error::Timeout {
                            what: "RabbitMQ's confirm of a forward".into(),
                            after: CONFIRM_WAIT,
                        }),
                    },
                    Err(e) => Err(e),
                };
                if let Err(e) = &ok {
                    nacked += usize::from(amqp::is_nack(e));
                }
                match ok {
                    Ok(()) => {
                        taken += 1;
                        h.delivery.acker.ack(BasicAckOptions::default()).await?;
                    }
                    Err(e) if h.since.elapsed() >= MAX_HOLD => {
                        refused += 1;
                        tracing::warn!(error = %e, queue = %queue, "a due delayed task refused for {} min: handed back to its tier", MAX_HOLD.as_secs() / 60);
                        h.delivery
                            .acker
                            .nack(BasicNackOptions {
                                requeue: true,
                                ..Default::default()
                            })
                            .await?;
                    }
                    Err(e) => {
                        refused += 1;
                        tracing::debug!(error = %e, queue = %queue, "forward refused; held for another try");
                        seq += 1;
                        let again = now.saturating_add(millis(REFUSED_PAUSE));
                        held.insert((again, seq), h);
                    }
                }
            }
            // `<ns>.delayed` has no bound: a channel stuck nacking it is renewed.
            s.note_publishes([(format!("{exchange}/{key}").as_str(), taken, nacked)])
                .await;
            if refused > 0 && !s.publisher().status().connected() {
                return Err(fleet::Error::ChannelClosed { what: "dispatch" });
            }
            // Warned once per spell of refusals, not per try.
            match (refused > 0, refusing) {
                (true, false) => {
                    tracing::warn!(refused, queue = %queue, target = %s.names.delayed_queue(), "RabbitMQ refuses forwards of due delayed tasks; held and tried again every {} ms", REFUSED_PAUSE.as_millis())
                }
                (false, true) => {
                    tracing::info!(queue = %queue, "forwards of due delayed tasks are taken again")
                }
                _ => {}
            }
            refusing = refused > 0;
        }
    }
}

/// When a delivery arriving at `now_ms` (fleet clock) is due: its hop's end `hop_due`
/// ([`delay::hop_due`]), but never more than one tier length `tier_ms` away (a skewed or
/// garbage header must not hold a tier); now when it carries none.
fn due_at(hop_due: Option<i64>, now_ms: i64, tier_ms: u64) -> i64 {
    let latest = now_ms.saturating_add(i64::try_from(tier_ms).unwrap_or(i64::MAX));
    hop_due.map_or(now_ms, |due| due.min(latest))
}

/// The wait from `now_ms` until `due_ms` (zero when passed).
fn millis_until(due_ms: i64, now_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(due_ms.saturating_sub(now_ms)).unwrap_or(0))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hop_is_held_at_most_one_tier() {
        assert_eq!(due_at(Some(1_300), 1_000, 800), 1_300);
        assert_eq!(due_at(Some(900), 1_000, 800), 900);
        // A clock far ahead, or a garbage header: one tier, no more.
        assert_eq!(due_at(Some(i64::MAX), 1_000, 800), 1_800);
        assert_eq!(due_at(None, 1_000, 800), 1_000);
        assert_eq!(due_at(Some(i64::MIN), 1_000, 800), i64::MIN);
    }

    #[test]
    fn a_wait_is_never_negative_nor_overflows() {
        assert_eq!(millis_until(1_500, 1_000), Duration::from_millis(500));
        assert_eq!(millis_until(1_000, 1_500), Duration::ZERO);
        assert_eq!(millis_until(i64::MIN, i64::MAX), Duration::ZERO);
        assert_eq!(
            millis_until(i64::MAX, i64::MIN),
            Duration::from_millis(i64::MAX as u64)
        );
    }
}
