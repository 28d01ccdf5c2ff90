//! The tier loops: the scheduler holds every delay tier's messages until their hop ends and
//! forwards them to `<ns>.delayed` (see [`fleet::delay`] for the layout and why fleet does
//! this itself rather than by queue TTL and dead-lettering; issue 37 item 1).
//!
//! One loop per tier per scheduler replica consumes `<ns>.hold.<ms>` with a prefetch of
//! [`PREFETCH`]. The messages of a tier all wait one length, so they come due in queue order:
//! the loop waits for the head's [`HOP_DUE`](fleet::headers::HOP_DUE), takes with it every
//! delivery already here that is due too, publishes them to `<ns>.delayed` together and acks
//! each tier copy once its forward is confirmed. A forward the broker refuses (the target
//! mid-election nacks) is handed back to the tier (`nack`, requeue) and the loop pauses
//! [`REFUSED_PAUSE`] before the next: it comes straight back, being due. A crash between the
//! confirm and the ack forwards a message twice, which the delayed path absorbs like any
//! redelivery (dedupe protocol, attempt records). Replicas compete for the messages like any
//! consumers; a replica that stops hands what it held back to the queue.

use std::sync::Arc;
use std::time::Duration;

use fleet::{amqp, delay, Names};
use futures::{FutureExt, StreamExt};
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
/// The pause after a refused forward before the next.
pub const REFUSED_PAUSE: Duration = Duration::from_millis(500);

/// Holds and forwards one delay tier.
pub struct TierLoop {
    pub session: Arc<Session>,
    /// The tier's length (ms).
    pub tier: u64,
}

impl TierLoop {
    /// Runs until `shutdown` (`Ok`; what the loop held goes back to the tier with its channel)
    /// or until the channel or the publisher fails (`Err`: the session restarts).
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let s = &self.session;
        let queue = s.names.delay_queue(self.tier);
        let ch = s.conn.create_channel().await?;
        ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
        let mut consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        tracing::debug!(queue = %queue, "holding a delay tier");
        let (exchange, key) = (s.names.tasks_exchange(), Names::DELAYED_KEY);
        let mut head: Option<Delivery> = None;
        loop {
            let first = match head.take() {
                Some(d) => d,
                None => tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(()),
                    d = consumer.next() => match d {
                        Some(Ok(d)) => d,
                        Some(Err(e)) => return Err(e.into()),
                        None => return Err(fleet::Error::Other(format!("consumer of {queue} ended"))),
                    },
                },
            };
            // Hold the head until its hop ends.
            let wait = wait_for(&first, s.store.clock.now_ms());
            if !wait.is_zero() {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            // With it, every delivery already here whose hop has ended too (queue order: the
            // first one not due is the next head).
            let mut batch = vec![first];
            while batch.len() < BATCH_MAX {
                match consumer.next().now_or_never() {
                    Some(Some(Ok(d))) => {
                        if wait_for(&d, s.store.clock.now_ms()).is_zero() {
                            batch.push(d);
                        } else {
                            head = Some(d);
                            break;
                        }
                    }
                    Some(Some(Err(e))) => return Err(e.into()),
                    _ => break,
                }
            }
            let confirms = amqp::publish_batch(
                &s.publisher,
                batch.iter().map(|d| amqp::Outgoing {
                    exchange: &exchange,
                    routing_key: key,
                    body: &d.data,
                    props: d.properties.clone(),
                }),
            )
            .await;
            let mut refused = 0usize;
            for (d, c) in batch.iter().zip(confirms) {
                let ok = match c {
                    Ok(c) => amqp::confirmed(c).await,
                    Err(e) => Err(e),
                };
                match ok {
                    Ok(()) => {
                        d.acker.ack(BasicAckOptions::default()).await?;
                    }
                    Err(e) => {
                        refused += 1;
                        tracing::debug!(error = %e, queue = %queue, "forward refused; back to its tier");
                        d.acker
                            .nack(BasicNackOptions {
                                requeue: true,
                                ..Default::default()
                            })
                            .await?;
                    }
                }
            }
            if refused > 0 && !s.publisher.status().connected() {
                return Err(fleet::Error::Other(
                    "the dispatch publisher channel is closed".into(),
                ));
            }
            if refused > 0 {
                tracing::warn!(refused, queue = %queue, target = %s.names.delayed_queue(), "RabbitMQ refused forwards of due delayed tasks; they went back to their tier, retrying in {} ms", REFUSED_PAUSE.as_millis());
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(REFUSED_PAUSE) => {}
                }
            }
        }
    }
}

/// How long a held delivery still waits at `now_ms` (fleet clock): until its hop's end, zero
/// when that has passed or it carries none ([`delay::hop_due`]).
fn wait_for(d: &Delivery, now_ms: i64) -> Duration {
    delay::hop_due(&d.properties)
        .map(|due| Duration::from_millis(u64::try_from(due - now_ms).unwrap_or(0)))
        .unwrap_or(Duration::ZERO)
}
