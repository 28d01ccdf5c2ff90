//! The consuming loops that feed the dispatcher: each ingress lane and the delayed queue.
//!
//! A loop takes the first delivery (waiting), then whatever else the broker has already
//! pushed (up to `batch_max`, without waiting), and hands the batch to the dispatcher. The
//! normal ingress lane is gated by backpressure: Red stops consuming (until the pressure
//! watch shows the gate leaving Red), Yellow sleeps part of the throttle delay between batches (in
//! proportion to how far into Yellow the gate is). The critical lane and the
//! delayed queue are never gated by normal-lane pressure.
//!
//! An ingress lane's loop settles the batches' closing messages of its batch first
//! ([`crate::batch_close`]), then dispatches the rest.

use std::sync::Arc;

use fleet::{metrics as m, Lane};
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::backpressure::{Pressure, Sample};
use crate::dispatch::{Dispatcher, Source};

/// Why a consuming loop paused intake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Paused {
    /// The intake gate turned Red: resume once it leaves Red.
    Red,
    /// A park queue refused a task (its bound reached): resume after `red_recheck`, giving its
    /// release loop time to drain it.
    ParkFull,
}

pub struct IngressLoop {
    pub dispatcher: Arc<Dispatcher>,
    pub source: Source,
    pub queue: String,
    pub pressure: watch::Receiver<Sample>,
    /// The delayed loop's: takes the delay canaries out of its batches (see [`crate::canary`]).
    pub canary: Option<Arc<crate::canary::Canary>>,
    /// An ingress lane's: settles batches' closing messages ([`crate::batch_close`]).
    pub closes: Option<Arc<crate::batch_close::Closes>>,
}

impl IngressLoop {
    /// Runs until shutdown (`Ok`) or until the channel fails (`Err`: the session restarts).
    ///
    /// When the gate turns Red the loop closes its channel, which hands every delivery it
    /// had prefetched back to the queue: waiting work waits *in the broker*, counted against
    /// the ingress bound, so refusals reach producers. It consumes again once the gate leaves
    /// Red (which the gate holds down to the yellow threshold and for the minimum dwell, unless
    /// the fleet has run dry: `backpressure::Sample::dry`).
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let cfg = self.dispatcher.session.cfg.clone();
        let gated = self.source == Source::Ingress(Lane::Normal);
        let mut park_full_pause = false;
        let mut pressure = self.pressure.clone();
        loop {
            // After a pause for a full park queue: give its release loop time to drain it.
            if park_full_pause {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(cfg.red_recheck) => {}
                }
            }
            if gated {
                // Red: wait for the gate to leave Red (every pressure sample can open it; the
                // gate itself holds Red down to the yellow threshold — see backpressure.rs).
                while self.pressure.borrow().gate == Pressure::Red {
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = pressure.wait_for(|s| s.gate != Pressure::Red) => {}
                        _ = tokio::time::sleep(cfg.red_recheck) => {}
                    }
                }
            }
            let ch = self.dispatcher.session.conn.create_channel().await?;
            // Prefetched deliveries do not count against the queue's bound, so never prefetch
            // more than the bound itself (the critical lane's bound is small on purpose).
            let prefetch = match &self.source {
                Source::Ingress(lane) => u32::from(cfg.batch_max)
                    .min(cfg.common.ingress_max[*lane])
                    .max(1) as u16,
                _ => cfg.batch_max,
            };
            ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
            let mut consumer = ch
                .basic_consume(
                    self.queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            tracing::info!(queue = %self.queue, "consuming");
            let paused = self.consume(&mut consumer, gated, &shutdown).await;
            let _ = ch.close(200, "paused".into()).await;
            match paused {
                Ok(Some(why)) => {
                    tracing::info!(queue = %self.queue, ?why, "intake paused; tasks wait in the broker");
                    park_full_pause = why == Paused::ParkFull;
                }
                Ok(None) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    /// Consumes batches until shutdown (`Ok(None)`) or a pause (`Ok(Some(why))`).
    async fn consume(
        &self,
        consumer: &mut lapin::Consumer,
        gated: bool,
        shutdown: &CancellationToken,
    ) -> fleet::Result<Option<Paused>> {
        let cfg = &self.dispatcher.session.cfg;
        // Under a rate limit a batch is at most one burst: a batch waits for all its tokens,
        // and several loops sharing one bucket must each get theirs in turn.
        let lane = self.source.lane().unwrap_or_default();
        let batch_max = match cfg.rate_for(lane) {
            Some((_, burst)) => usize::try_from(burst)
                .unwrap_or(usize::MAX)
                .clamp(1, usize::from(cfg.batch_max)),
            None => usize::from(cfg.batch_max),
        };
        let mut pressure = self.pressure.clone();
        let mut refused = crate::dispatch::RefusalBackoff::default();
        loop {
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(None),
                _ = pressure.wait_for(|s| s.gate == Pressure::Red), if gated => return Ok(Some(Paused::Red)),
                d = consumer.next() => d,
            };
            let first = match first {
                Some(Ok(d)) => d,
                Some(Err(e)) => return Err(e.into()),
                None => {
                    return Err(fleet::Error::ConsumerEnded {
                        queue: self.queue.to_string(),
                    })
                }
            };
            let mut batch = vec![first];
            while batch.len() < batch_max {
                match consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => batch.push(d),
                    Some(Some(Err(e))) => return Err(e.into()),
                    _ => break,
                }
            }
            if let Some(c) = &self.canary {
                batch = c.take(batch).await;
                if batch.is_empty() {
                    continue;
                }
            }
            if let Some(c) = &self.closes {
                batch = c.take(batch, shutdown).await?;
                if batch.is_empty() {
                    continue;
                }
            }
            let out = self.dispatcher.process(batch, &self.source, shutdown).await;
            out.check_publisher(&self.dispatcher.session)?;
            // Publishes the broker refused put their sources back at the head of this queue:
            // taking them again at once is a hot loop against a queue that cannot take them
            // (a quorum leader being elected nacks every publish for seconds).
            if let Some(wait) = refused.after(&out) {
                tracing::warn!(queue = %self.queue, refused = out.failed, retry_in_ms = wait.as_millis() as u64, "publishes refused by RabbitMQ; their tasks went back to the queue, pausing before the next batch");
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            if out.park_full {
                tracing::warn!(queue = %self.queue, "a park queue is full: pausing intake");
                return Ok(Some(Paused::ParkFull));
            }
            if gated {
                let gate = self.pressure.borrow().gate;
                match gate {
                    Pressure::Red => return Ok(Some(Paused::Red)),
                    Pressure::Yellow => {
                        // In proportion to how far into Yellow the fleet is: nothing at the
                        // yellow threshold, the whole throttle delay at red.
                        let t = crate::backpressure::Thresholds::from_config(cfg);
                        let waiting = self.pressure.borrow().waiting;
                        let depth = crate::backpressure::yellow_depth(&t, waiting);
                        metrics::counter!(m::DISPATCH_THROTTLED).increment(out.dispatched as u64);
                        tokio::select! {
                            _ = shutdown.cancelled() => return Ok(None),
                            _ = tokio::time::sleep(cfg.throttle.mul_f64(depth)) => {}
                        }
                    }
                    Pressure::Green => {}
                }
            }
        }
    }
}
