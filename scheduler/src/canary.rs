//! The delay canary: notices a delay path that stopped moving (issue 37 item 1).
//!
//! Delayed tasks and retries wait in the delay tiers (`<ns>.wait.<ms>`), which dead-letter into
//! `<ns>.delayed` at least once: a tier keeps each expired message until the target confirmed
//! it. When the node leading `<ns>.delayed` dies, the dead-letter worker's send to the lost
//! leader is never confirmed and — with RabbitMQ's default `dead_letter_worker_publisher_confirm_timeout`
//! of 180 s — nothing is re-sent for three minutes: every due task sits in the tiers, the
//! workers idle, and the queue depths fleet reads say nothing (the held messages are not
//! "ready"). fleet ships the setting at 5 s (`ops/rabbitmq/advanced.config`), and this loop
//! makes a stuck path visible wherever the setting is missing or the path stalls otherwise.
//!
//! Every [`INTERVAL`] the loop publishes a canary — a message with the [`HEADER`] header (its
//! send time, ms since the epoch) and no envelope — into the shortest tier (100 ms). The
//! delayed loop takes canaries out of its batches ([`Canary::take`]) and acks them, recording
//! the newest send time that came back. `fleet_delay_canary_age_seconds` is the age of the
//! newest canary back (since this session started, before the first): about [`INTERVAL`] while
//! the path moves, growing while it is stuck. Past [`STUCK_AFTER`] the loop logs a warning once
//! (and once more when the path moves again); `FleetDelayPathStuck` alerts on the gauge
//! (ops/prometheus/failover.yml). With several scheduler replicas each one sends its own and
//! counts whichever come back to it: every replica consuming `<ns>.delayed` sees canaries while
//! the path moves.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet::amqp::{self, TIER_HEADER};
use fleet::{metrics as m, Names};
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
/// The tier canaries go through (the shortest).
const TIER_MS: u64 = fleet::delay::BASE_MS;

/// What the delayed loop and the canary loop share.
#[derive(Debug)]
pub struct Canary {
    /// Send time of the newest canary back; the session's start before the first.
    newest_ms: AtomicI64,
    stuck: AtomicBool,
}

impl Canary {
    pub fn new() -> Arc<Self> {
        Arc::new(Canary {
            newest_ms: AtomicI64::new(fleet::store::now_ms()),
            stuck: AtomicBool::new(false),
        })
    }

    /// Takes the canaries out of a batch of `<ns>.delayed` deliveries, recording and acking
    /// each; returns the rest.
    pub async fn take(&self, batch: Vec<Delivery>) -> Vec<Delivery> {
        let mut rest = Vec::with_capacity(batch.len());
        for d in batch {
            match sent_ms(&d) {
                Some(sent) => {
                    self.newest_ms.fetch_max(sent, Ordering::Relaxed);
                    if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
                        tracing::debug!(error = %e, "cannot ack a delay canary (redelivered, counted again)");
                    }
                }
                None => rest.push(d),
            }
        }
        rest
    }

    /// How old the newest canary back is at `now_ms` (ms since the epoch), in seconds.
    pub fn age_s(&self, now_ms: i64) -> f64 {
        (now_ms - self.newest_ms.load(Ordering::Relaxed)).max(0) as f64 / 1000.0
    }
}

/// A canary's send time, `None` for any other delivery.
fn sent_ms(d: &Delivery) -> Option<i64> {
    amqp::header_text(&d.properties, HEADER)?.parse().ok()
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
        let gauge = metrics::gauge!(m::DELAY_CANARY_AGE);
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {}
            }
            let now = fleet::store::now_ms();
            let h = amqp::headers([
                (TIER_HEADER, TIER_MS.to_string()),
                (HEADER, now.to_string()),
            ]);
            // Not awaited for its confirm: a stuck path must not stall the loop that reports it.
            if let Err(e) = amqp::publish(
                &self.session.publisher,
                &exchange,
                "",
                b"{}",
                amqp::task_properties("delay-canary", Some(h)),
            )
            .await
            {
                tracing::debug!(error = %e, "cannot send a delay canary");
            }
            let age = self.canary.age_s(now);
            gauge.set(age);
            let stuck = age > STUCK_AFTER.as_secs_f64();
            if stuck != self.canary.stuck.swap(stuck, Ordering::Relaxed) {
                if stuck {
                    tracing::warn!(age_s = age, queue = %names.delayed_queue(), "the delay path is stuck: no canary came back from the delay tiers through {} for {age:.0} s; delayed tasks and retries are waiting past their due time (is dead_letter_worker_publisher_confirm_timeout set? see ops/rabbitmq/advanced.config)", names.delayed_queue());
                } else {
                    tracing::info!(
                        age_s = age,
                        "the delay path moves again: canaries come back from the delay tiers"
                    );
                }
            }
        }
    }
}

/// The canary tier's queue (for docs and tests).
pub fn tier_queue(names: &Names) -> String {
    names.delay_queue(TIER_MS)
}
