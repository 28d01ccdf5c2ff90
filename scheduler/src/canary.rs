//! The delay canary: notices a delay path that stopped moving (issue 37 item 1).
//!
//! Delayed tasks and retries wait in the delay tiers (`<ns>.hold.<ms>`), which the scheduler's
//! tier loops hold and forward to `<ns>.delayed` ([`crate::tiers`]). Until issue 37 the tiers
//! expired messages by TTL into `<ns>.delayed` through RabbitMQ's at-least-once dead-letter
//! worker, which stalled for minutes when a node leading `<ns>.delayed` or a tier died — every
//! due task sat in the tiers, the workers idle, and the queue depths fleet reads said nothing.
//! The tier loops removed that path; this loop stays as the end-to-end check that the delay
//! path moves, whatever stalls it (a tier without a leader, a stuck forward, a scheduler
//! without its loops).
//!
//! Every [`INTERVAL`] the loop publishes a canary — a message with the [`HEADER`] header (its
//! send time, ms since the epoch) and no envelope — into each of the short tiers
//! ([`TIERS`]: 100 ms … 12.8 s, where retries' backoff and near delays wait). The delayed loop
//! takes canaries out of its batches ([`Canary::take`]) and acks them, recording per tier the
//! newest send time that came back. `fleet_delay_canary_age_seconds{tier}` is the age of the
//! newest canary back through that tier, less the tier's own wait (since this session
//! started, before the first): about [`INTERVAL`] while the tier moves, growing while it is
//! stuck. Past [`STUCK_AFTER`] the loop logs a warning naming the tier once (and once more when
//! it moves again); `FleetDelayPathStuck` alerts on the gauge (ops/prometheus/failover.yml).
//! With several scheduler
//! replicas each one sends its own and counts whichever come back to it: every replica
//! consuming `<ns>.delayed` sees canaries while the path moves.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet::broker::amqp::{self, TIER_HEADER};
use fleet::metrics as m;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use tokio_util::sync::CancellationToken;

use crate::session::Session;

/// The header that marks a canary; its value is the send time (ms since the epoch).
pub const HEADER: &str = "x-fleet-delay-canary";
/// How often a canary is sent.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// The age past which the path counts as stuck (logged; the alert waits longer): four canaries
/// missing, well past a leader election's few seconds.
pub const STUCK_AFTER: Duration = Duration::from_secs(20);
/// How many of the shortest tiers canaries go through: 100 ms × 2^0 … 2^7 (12.8 s).
pub const TIERS: usize = 8;

/// The tiers canaries go through, shortest first.
pub fn tiers() -> impl Iterator<Item = u64> {
    fleet::broker::delay::tiers().take(TIERS)
}

/// What the delayed loop and the canary loop share.
#[derive(Debug)]
pub struct Canary {
    /// Per tier of [`tiers`]: send time of the newest canary back; the session's start
    /// before the first.
    newest_ms: [AtomicI64; TIERS],
    stuck: [AtomicBool; TIERS],
}

impl Canary {
    pub fn new() -> Arc<Self> {
        let now = fleet::redis::now_ms();
        Arc::new(Canary {
            newest_ms: std::array::from_fn(|_| AtomicI64::new(now)),
            stuck: std::array::from_fn(|_| AtomicBool::new(false)),
        })
    }

    /// Takes the canaries out of a batch of `<ns>.delayed` deliveries, recording and acking
    /// each; returns the rest.
    pub async fn take(&self, batch: Vec<Delivery>) -> Vec<Delivery> {
        let mut rest = Vec::with_capacity(batch.len());
        for d in batch {
            match sent_ms(&d) {
                Some((sent, tier)) => {
                    if let Some(i) = tiers().position(|t| t == tier) {
                        self.newest_ms[i].fetch_max(sent, Ordering::Relaxed);
                    }
                    if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
                        tracing::debug!(error = %e, "cannot ack a delay canary (redelivered, counted again)");
                    }
                }
                None => rest.push(d),
            }
        }
        rest
    }

    /// How old the newest canary back through the `i`-th tier of [`tiers`] (`tier_ms` long) is
    /// at `now_ms` (ms since the epoch), less the tier's own wait, in seconds.
    pub fn age_s(&self, i: usize, tier_ms: u64, now_ms: i64) -> f64 {
        let newest = self.newest_ms[i].load(Ordering::Relaxed);
        (now_ms - newest - tier_ms as i64).max(0) as f64 / 1000.0
    }
}

/// A canary's send time and tier, `None` for any other delivery.
fn sent_ms(d: &Delivery) -> Option<(i64, u64)> {
    let sent = amqp::header_text(&d.properties, HEADER)?.parse().ok()?;
    let tier = amqp::header_text(&d.properties, TIER_HEADER)
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    Some((sent, tier))
}

/// Sends the canaries and watches their age (see the module docs).
pub struct CanaryLoop {
    pub session: Arc<Session>,
    pub canary: Arc<Canary>,
}

impl CanaryLoop {
    /// Runs until `shutdown`. A failed send is logged and retried at the next tick (the age
    /// then grows, which is the point).
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let names = &self.session.names;
        let exchange = names.delay_exchange();
        let gauges: Vec<metrics::Gauge> = tiers()
            .map(|t| metrics::gauge!(m::DELAY_CANARY_AGE, "tier" => t.to_string()))
            .collect();
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {}
            }
            let now = fleet::redis::now_ms();
            let hop_now = self.session.store.clock.now_ms();
            for (i, tier) in tiers().enumerate() {
                let h = amqp::headers(
                    fleet::broker::delay::hop(tier, hop_now)
                        .into_iter()
                        .chain([(HEADER, now.to_string())]),
                );
                // Not awaited for its confirm: a stuck path must not stall the loop reporting it.
                if let Err(e) = amqp::publish(
                    &self.session.publisher(),
                    &exchange,
                    "",
                    b"{}",
                    amqp::task_properties("delay-canary", Some(h)),
                )
                .await
                {
                    tracing::debug!(error = %e, tier, "cannot send a delay canary");
                }
                let age = self.canary.age_s(i, tier, now);
                if let Some(g) = gauges.get(i) {
                    g.set(age);
                }
                let stuck = age > STUCK_AFTER.as_secs_f64();
                if stuck != self.canary.stuck[i].swap(stuck, Ordering::Relaxed) {
                    let queue = names.delay_queue(tier);
                    if stuck {
                        tracing::warn!(age_s = age, tier, queue = %queue, target = %names.delayed_queue(), "a delay tier is stuck: no canary came back through it for {age:.0} s past its wait; delayed tasks and retries in it wait past their due time (see ops/README.md, FleetDelayPathStuck)");
                    } else {
                        tracing::info!(age_s = age, tier, queue = %queue, "a delay tier moves again: canaries come back through it");
                    }
                }
            }
        }
    }
}
