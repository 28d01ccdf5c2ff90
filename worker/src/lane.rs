//! A lane consumer: one per lane (`normal`, `critical`), each on its own AMQP channel with its
//! own capacity, so critical tasks and health probes flow while the normal lane is saturated.
//!
//! Bounded work: the channel's prefetch equals the lane's capacity, and a semaphore of the same
//! size hands out a permit before a delivery is spawned; the permit moves into the task and is
//! given back when it is acked. So the broker never pushes more than the worker runs, and the
//! rest of the group queue stays in the broker for the worker's peers.
//!
//! A sharded lane (`FLEET_SHARDS` > 1, see [`fleet::broker`]) consumes several shard queues on
//! the one channel, one consumer each, the capacity split over them as per-consumer prefetch
//! (`basic.qos` with `global = false` before each `basic.consume`; quorum queues do not support
//! a channel-wide prefetch), and the one semaphore still bounds what runs. When the set of
//! shards changes ([`crate::shards`]) the lane cancels its consumers like a pause and consumes
//! the new set.
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

use fleet::broker::Subsetting;
use fleet::process::Stage;
use fleet::Lane;

use crate::acks::AckWindow;
use crate::attempt::{self, Shared};
use crate::broker::Broker;
use crate::drain::{Control, Mode};

/// How long `basic.cancel` is awaited, and then a cancelled consumer's in-flight deliveries (to nack them back).
const CANCEL_FLUSH: Duration = Duration::from_secs(2);

/// The deliveries of every consumer of a session, merged.
type Deliveries = futures::stream::SelectAll<Consumer>;

/// One lane's consumer loop.
pub struct LaneConsumer {
    pub lane: Lane,
    pub capacity: u32,
    /// The queues to consume: one (an unsharded lane) or this worker's shard subset; a new
    /// value makes the lane consume the new set.
    pub queues: watch::Receiver<Vec<String>>,
    pub shared: Arc<Shared>,
    pub broker: Arc<Broker>,
    pub control: Control,
    /// Where task attempts are spawned (the drain waits for them).
    pub work: Stage,
}

/// Why a consume session ended.
enum Ended {
    /// Draining or shut down: the lane is done.
    Stopped,
    /// Ejected: wait to be active again.
    Paused,
    /// The shard subset changed: consume the new set.
    Moved,
    /// Channel or connection trouble: reconnect after a backoff.
    Lost(String),
}

impl LaneConsumer {
    pub async fn run(mut self, shutdown: CancellationToken) {
        let permits = Arc::new(Semaphore::new(self.capacity as usize));
        let mut mode = self.control.watch();
        let mut delay = Duration::from_millis(200);
        let mut session = 0u64;
        let mut redeclare = false;
        let mut revived = self.broker.consuming_watch();
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
            match self
                .session(&conn, session, &permits, &mut mode, &shutdown, &mut delay)
                .await
            {
                Ended::Stopped => return,
                Ended::Paused => {
                    tracing::info!("consumer cancelled while ejected");
                    redeclare = false;
                }
                Ended::Moved => redeclare = false,
                Ended::Lost(why) => {
                    self.shared.stats.set_consuming(self.lane, Vec::new());
                    redeclare = true;
                    if !conn.status().connected() {
                        // The connection went with the channel: `Broker::connection` reconnects
                        // with one backoff for every lane, so no lane adds a pause of its own
                        // and both lanes come back together (issue 37 item 5).
                        tracing::warn!(error = %why, "consumer lost with its connection; reconnecting");
                        continue;
                    }
                    tracing::warn!(error = %why, retry_in_ms = delay.as_millis() as u64, "consumer lost; consuming again after a pause");
                    // The pause ends early when another lane consumes again: the broker is back.
                    // Not before a floor of 200 ms, so two lanes whose channels keep closing
                    // right after `basic.consume` cannot wake each other into a loop.
                    revived.borrow_and_update();
                    let floor = tokio::time::sleep(Duration::from_millis(200).min(delay));
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => return,
                        _ = self.control.draining() => return,
                        _ = floor => {}
                    }
                    tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => return,
                        _ = self.control.draining() => return,
                        _ = revived.changed() => {}
                        _ = tokio::time::sleep(jitter(delay).saturating_sub(Duration::from_millis(200))) => {}
                    }
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// Consumes on a fresh channel until the mode changes or the channel fails.
    async fn session(
        &mut self,
        conn: &Connection,
        session: u64,
        permits: &Arc<Semaphore>,
        mode: &mut watch::Receiver<Mode>,
        shutdown: &CancellationToken,
        delay: &mut Duration,
    ) -> Ended {
        let tag = format!("{}.{}.{}", self.shared.worker_id, self.lane, session);
        let queues = self.queues.borrow_and_update().clone();
        let (channel, tags, mut consumer) = match self.open(conn, &tag, &queues).await {
            // Shared by every attempt of the session behind one `Arc`: a lapin `Channel` is a
            // dozen reference counts, and each attempt holds the channel until its ack.
            Ok((channel, tags, consumer)) => (Arc::new(channel), tags, consumer),
            Err(e) => return Ended::Lost(e.to_string()),
        };
        tracing::info!(consumer_tag = %tag, queues = ?queues, prefetch = self.capacity, "consuming");
        self.shared.stats.set_consuming(self.lane, queues.clone());
        self.broker.lane_consuming();
        *delay = Duration::from_millis(200);
        // Acks of this channel's deliveries, coalesced into `multiple` acks (see crate::acks).
        let acks = AckWindow::default();
        loop {
            let delivery = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return self.stop(&channel, &tags, &mut consumer, Ended::Stopped).await,
                changed = mode.changed() => {
                    let now = *mode.borrow_and_update();
                    match (changed, now) {
                        (Ok(()), Mode::Active) => continue,
                        (Ok(()), Mode::Ejected) => return self.stop(&channel, &tags, &mut consumer, Ended::Paused).await,
                        _ => return self.stop(&channel, &tags, &mut consumer, Ended::Stopped).await,
                    }
                }
                Ok(()) = self.queues.changed() => {
                    tracing::info!(from = ?queues, to = ?*self.queues.borrow(), "shards changed; consuming the new set");
                    return self.stop(&channel, &tags, &mut consumer, Ended::Moved).await;
                }
                d = consumer.next() => d,
            };
            let delivery = match delivery {
                Some(Ok(d)) => d,
                Some(Err(e)) => return Ended::Lost(e.to_string()),
                None => {
                    return Ended::Lost("consumer cancelled by the broker (queue deleted?)".into())
                }
            };
            let slot = acks.slot(&delivery);
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
            // Boxed: an attempt's future is ~3.5 KB (`size_of_val`; its rare paths — a direct
            // claim's Redis call, dead-lettering, a retry's publish — are boxed where they are
            // awaited), and the span and task-tracker wrappers and tokio's task cell would each
            // move it whole.
            self.work.spawn_here(Box::pin(attempt::handle(
                shared,
                self.lane,
                delivery,
                slot,
                channel.clone(),
                permit,
            )));
        }
    }

    /// Opens a channel and one consumer per queue (tag `<tag>` for a single queue, else
    /// `<tag>.<i>`), each with its share of the capacity as prefetch.
    async fn open(
        &self,
        conn: &Connection,
        tag: &str,
        queues: &[String],
    ) -> lapin::Result<(Channel, Vec<String>, Deliveries)> {
        let channel = conn.create_channel().await?;
        let prefetch = Subsetting::split_prefetch(self.capacity, queues.len());
        let mut tags = Vec::with_capacity(queues.len());
        let mut consumers = Vec::with_capacity(queues.len());
        for (i, (queue, prefetch)) in queues.iter().zip(prefetch).enumerate() {
            let tag = if queues.len() == 1 {
                tag.to_string()
            } else {
                format!("{tag}.{i}")
            };
            channel
                .basic_qos(prefetch, BasicQosOptions::default())
                .await?;
            let consumer = channel
                .basic_consume(
                    ShortString::from(queue.as_str()),
                    ShortString::from(tag.as_str()),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            tags.push(tag);
            consumers.push(consumer);
        }
        Ok((channel, tags, futures::stream::select_all(consumers)))
    }

    /// Cancels the consumers and nacks back whatever was already on its way.
    async fn stop(
        &self,
        channel: &Channel,
        tags: &[String],
        consumer: &mut Deliveries,
        ended: Ended,
    ) -> Ended {
        self.shared.stats.set_consuming(self.lane, Vec::new());
        // All cancels at once, bounded: a broker that does not answer must not hold up a
        // drain (the channel closes with the connection, which returns what it delivered).
        let cancels = futures::future::join_all(tags.iter().map(|tag| {
            channel.basic_cancel(
                ShortString::from(tag.as_str()),
                BasicCancelOptions::default(),
            )
        }));
        match tokio::time::timeout(CANCEL_FLUSH, cancels).await {
            Ok(results) => {
                if let Some(e) = results.into_iter().find_map(Result::err) {
                    tracing::debug!(error = %e, "basic.cancel failed (channel gone)");
                    return ended;
                }
            }
            // Go on to the flush: what the consumers deliver meanwhile is nacked back rather
            // than held by a channel nobody reads (an ejection or a shard move keeps the
            // connection open). The cancels were sent; the broker applies them when it answers.
            Err(_) => tracing::warn!(
                consumers = tags.len(),
                limit_ms = CANCEL_FLUSH.as_millis() as u64,
                "RabbitMQ did not answer basic.cancel; returning what it delivers, then going on"
            ),
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

/// Waits until the mode is `Active`; false when draining or shut down.
///
/// # Cancel safety
/// Cancel safe: it only reads the mode; the next call reads the current mode again, so a
/// change seen by a dropped call is not lost.
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
