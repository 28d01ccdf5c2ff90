//! A lane consumer: one per lane (`normal`, `critical`), each on its own AMQP channel with its
//! own capacity, so critical tasks and health probes flow while the normal lane is saturated.
//!
//! Bounded work: the channel's prefetch equals the lane's capacity, and a semaphore of the same
//! size hands out a permit before a delivery is spawned; the permit moves into the task and is
//! given back when it is acked. So the broker never pushes more than the worker runs, and the
//! rest of the group queue stays in the broker for the worker's peers.
//!
//! The lane consumes only while the worker is `Active`. On `Ejected` or `Draining` it cancels
//! its consumer (`basic.cancel`: the broker stops delivering) and nacks, with requeue, any
//! delivery already on its way; tasks already running finish and ack on the old channel, which
//! stays open as long as one of them holds it. When the channel or connection is lost the lane
//! logs, backs off, reconnects (declaring the topology again) and consumes again; tasks from
//! the lost channel cannot be acked and come back from the broker (at-least-once).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, Consumer};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use fleet::Lane;

use crate::attempt::{self, Shared};
use crate::broker::Broker;
use crate::drain::{Control, Mode};

/// How long a cancelled consumer's in-flight deliveries are awaited (to nack them back).
const CANCEL_FLUSH: Duration = Duration::from_secs(2);

/// One lane's consumer loop.
pub struct LaneConsumer {
    pub lane: Lane,
    pub capacity: u32,
    pub queue: String,
    pub shared: Arc<Shared>,
    pub broker: Arc<Broker>,
    pub control: Control,
    /// Where task attempts are spawned (the drain waits for them).
    pub tasks: TaskTracker,
}

/// Why a consume session ended.
enum Ended {
    /// Draining or shut down: the lane is done.
    Stopped,
    /// Ejected: wait to be active again.
    Paused,
    /// Channel or connection trouble: reconnect after a backoff.
    Lost(String),
}

impl LaneConsumer {
    pub async fn run(self, shutdown: CancellationToken) {
        let span = tracing::info_span!("lane", lane = %self.lane, queue = %self.queue);
        async move {
            let permits = Arc::new(Semaphore::new(self.capacity as usize));
            let mut mode = self.control.watch();
            let mut delay = Duration::from_millis(200);
            let mut session = 0u64;
            let mut redeclare = false;
            loop {
                if !wait_active(&mut mode, &shutdown).await {
                    return;
                }
                let conn = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    _ = self.control.draining() => return,
                    c = self.broker.connection() => match c { Some(c) => c, None => return },
                };
                if redeclare {
                    if let Err(e) = self.broker.redeclare().await {
                        tracing::warn!(error = %e, "cannot declare the topology again");
                    }
                }
                session += 1;
                match self.session(&conn, session, &permits, &mut mode, &shutdown, &mut delay).await {
                    Ended::Stopped => return,
                    Ended::Paused => {
                        tracing::info!("consumer cancelled while ejected");
                        redeclare = false;
                    }
                    Ended::Lost(why) => {
                        tracing::warn!(error = %why, retry_in_ms = delay.as_millis() as u64, "consumer lost; consuming again after a pause");
                        redeclare = true;
                        tokio::select! {
                            biased;
                            _ = shutdown.cancelled() => return,
                            _ = self.control.draining() => return,
                            _ = tokio::time::sleep(jitter(delay)) => {}
                        }
                        delay = (delay * 2).min(Duration::from_secs(10));
                    }
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Consumes on a fresh channel until the mode changes or the channel fails.
    async fn session(
        &self,
        conn: &Connection,
        session: u64,
        permits: &Arc<Semaphore>,
        mode: &mut watch::Receiver<Mode>,
        shutdown: &CancellationToken,
        delay: &mut Duration,
    ) -> Ended {
        let tag = format!("{}.{}.{}", self.shared.worker_id, self.lane, session);
        let (channel, mut consumer) = match self.open(conn, &tag).await {
            Ok(c) => c,
            Err(e) => return Ended::Lost(e.to_string()),
        };
        tracing::info!(consumer_tag = %tag, prefetch = self.capacity, "consuming");
        *delay = Duration::from_millis(200);
        loop {
            let delivery = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return self.stop(&channel, &tag, &mut consumer, Ended::Stopped).await,
                changed = mode.changed() => {
                    let now = *mode.borrow_and_update();
                    match (changed, now) {
                        (Ok(()), Mode::Active) => continue,
                        (Ok(()), Mode::Ejected) => return self.stop(&channel, &tag, &mut consumer, Ended::Paused).await,
                        _ => return self.stop(&channel, &tag, &mut consumer, Ended::Stopped).await,
                    }
                }
                d = consumer.next() => d,
            };
            let delivery = match delivery {
                Some(Ok(d)) => d,
                Some(Err(e)) => return Ended::Lost(e.to_string()),
                None => return Ended::Lost("consumer cancelled by the broker (queue deleted?)".into()),
            };
            // A free slot first; the prefetch makes waiting rare (only after a reconnect, while
            // tasks of the lost channel still run).
            let permit = tokio::select! {
                biased;
                p = permits.clone().acquire_owned() => p.ok(),
                _ = self.control.draining() => None,
                _ = shutdown.cancelled() => None,
            };
            let Some(permit) = permit else {
                attempt::nack_requeue(&delivery).await;
                continue; // the next turn sees the mode change or shutdown
            };
            let shared = self.shared.clone();
            self.tasks.spawn(attempt::handle(shared, self.lane, delivery, channel.clone(), permit).in_current_span());
        }
    }

    async fn open(&self, conn: &Connection, tag: &str) -> lapin::Result<(Channel, Consumer)> {
        let channel = conn.create_channel().await?;
        let prefetch = u16::try_from(self.capacity).unwrap_or(u16::MAX);
        channel.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let consumer = channel
            .basic_consume(
                ShortString::from(self.queue.as_str()),
                ShortString::from(tag),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok((channel, consumer))
    }

    /// Cancels the consumer and nacks back whatever was already on its way.
    async fn stop(&self, channel: &Channel, tag: &str, consumer: &mut Consumer, ended: Ended) -> Ended {
        if let Err(e) = channel.basic_cancel(ShortString::from(tag), BasicCancelOptions::default()).await {
            tracing::debug!(error = %e, "basic.cancel failed (channel gone)");
            return ended;
        }
        let mut returned = 0u32;
        let flush = async {
            while let Some(Ok(d)) = consumer.next().await {
                attempt::nack_requeue(&d).await;
                returned += 1;
            }
        };
        let _ = tokio::time::timeout(CANCEL_FLUSH, flush).await;
        tracing::info!(returned, "consumer cancelled");
        ended
    }
}

/// Waits until the mode is `Active`; false when draining or shut down. Cancel safe.
async fn wait_active(mode: &mut watch::Receiver<Mode>, shutdown: &CancellationToken) -> bool {
    loop {
        let now = *mode.borrow_and_update();
        match now {
            Mode::Active => return true,
            Mode::Draining => return false,
            Mode::Ejected => {}
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return false,
            r = mode.changed() => if r.is_err() { return false },
        }
    }
}

/// Between half and all of `d`, so lanes of many workers do not reconnect in lockstep.
fn jitter(d: Duration) -> Duration {
    d.mul_f64(0.5 + rand::random::<f64>() / 2.0)
}
