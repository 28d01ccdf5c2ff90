//! Batches over AMQP: the ingress's handling of a batch's **closing message** (see
//! [`fleet::batch`], "Over AMQP: the closing message").
//!
//! An ingress loop takes the deliveries whose AMQP `type` is [`fleet::batch::CLOSE_TYPE`] out
//! of each batch ([`Closes::take`]) before the rest is dispatched, and settles each one there
//! and then (so the batch's one `multiple` ack of the rest never covers a close):
//!
//! * a close that defines a batch ([`crate::batch_def::define`], [`Form::Close`]): its
//!   `BatchDef` record is appended to the control stream (publisher confirm), then the close
//!   is acked. Not confirmed: the close is requeued (it comes again) and the loop pauses
//!   ([`RETRY`]) so a broker that cannot take the record is not asked in a hot loop. A batch
//!   this replica already knows (a repeated close) is acked without a record.
//! * a close that defines nothing: published to the dead-letter queue with reason
//!   `bad_batch` and the refusal as detail (`<code>: <detail> (task <index>)`), the close's
//!   own bytes and properties kept; acked once the dead letter is confirmed, requeued when not.
//!
//! A close costs the hot path one property comparison per delivery.

use std::sync::Arc;
use std::time::Duration;

use fleet::broker::amqp::{self, DETAIL_HEADER, REASON_HEADER};
use fleet::{metrics as m, status::DeadReason, Names};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;

use crate::batch_def::{Ctx, Form};
use crate::session::Session;

/// The pause after a close that could not be settled (its record or dead letter not
/// confirmed), before the loop takes its next batch.
pub const RETRY: Duration = Duration::from_millis(500);

/// What an ingress loop needs to settle closes.
pub struct Closes {
    /// The session: publisher, store, names, config.
    pub session: Arc<Session>,
    /// This replica's batches (a repeated close is recognised here).
    pub batches: fleet::batch::Batches,
}

/// Whether `d` is a batch's closing message.
pub fn is_close(d: &Delivery) -> bool {
    d.properties
        .kind()
        .as_ref()
        .is_some_and(|k| k.as_str() == fleet::batch::CLOSE_TYPE)
}

impl Closes {
    /// Settles the closes of `batch` (see the module docs) and returns the other deliveries,
    /// in order. Pauses [`RETRY`] (or until shutdown) when a close went back to its queue.
    ///
    /// # Errors
    /// A close was not settled and the session's publisher is closed: every later publish
    /// would fail too, so the loop ends (the session restarts with a new publisher). The
    /// unsettled deliveries go back to the queue with the loop's channel.
    pub async fn take(
        &self,
        batch: Vec<Delivery>,
        shutdown: &CancellationToken,
    ) -> fleet::Result<Vec<Delivery>> {
        if !batch.iter().any(is_close) {
            return Ok(batch);
        }
        let (closes, rest): (Vec<Delivery>, Vec<Delivery>) = batch.into_iter().partition(is_close);
        let mut requeued = false;
        for d in closes {
            if !self.settle(d).await {
                requeued = true;
            }
        }
        if requeued {
            if !self.session.publisher().status().connected() {
                return Err(fleet::Error::ChannelClosed {
                    what: "batch close",
                });
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(RETRY) => {}
            }
        }
        Ok(rest)
    }

    /// Defines (or dead-letters) the batch of close `d` and acks it; `false` when it went back
    /// to its queue (nothing confirmed).
    async fn settle(&self, d: Delivery) -> bool {
        let s = &self.session;
        let cfg = &s.cfg.common;
        let ctx = Ctx {
            limits: &cfg.limits,
            default_max_attempts: cfg.default_max_attempts,
            now: s.store.clock.now(),
            now_ms: s.store.clock.now_ms(),
            key: None,
        };
        let done = match crate::batch_def::define(&d.data, Form::Close, &ctx) {
            Ok(def) => {
                let publisher = s.publisher();
                match crate::batch_def::commit(
                    &def,
                    Some(&publisher),
                    &s.store,
                    &self.batches,
                    cfg.status_ttl,
                )
                .await
                {
                    Ok(new) => {
                        tracing::info!(batch = %def.batch, members = def.ids.len(), waiting = def.waiting.len(), new, "batch closed over AMQP");
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Err(r) => {
                let detail = r.line();
                let res = self.dead_letter(&d, &detail).await;
                if res.is_ok() {
                    metrics::counter!(m::TASKS_REJECTED, "reason" => DeadReason::BadBatch.as_str())
                        .increment(1);
                    let batch = serde_json::from_slice::<serde_json::Value>(&d.data)
                        .ok()
                        .and_then(|v| v.get("id").and_then(|i| i.as_str()).map(str::to_string));
                    tracing::warn!(reason = DeadReason::BadBatch.as_str(), detail = %detail, batch = batch.as_deref().unwrap_or("-"), "batch close dead-lettered");
                }
                res
            }
        };
        match done {
            Ok(()) => {
                if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
                    tracing::warn!(error = %e, "ack of a batch close failed (it will come again: a repeat changes nothing)");
                }
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "a batch close was not settled (nothing confirmed); requeueing it");
                let _ = d
                    .acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await;
                false
            }
        }
    }

    /// Publishes close `d` to the dead-letter queue with reason `bad_batch` and `detail`
    /// (its bytes and properties kept, the reason headers added); `Ok` once confirmed.
    async fn dead_letter(&self, d: &Delivery, detail: &str) -> fleet::Result<()> {
        let s = &self.session;
        let mut headers: FieldTable = d.properties.headers().clone().unwrap_or_default();
        for (k, v) in [
            (REASON_HEADER, DeadReason::BadBatch.as_str().to_string()),
            (DETAIL_HEADER, detail.to_string()),
        ] {
            headers.insert(k.into(), AMQPValue::LongString(v.into()));
        }
        let mut props = d.properties.clone().with_headers(headers);
        if props.delivery_mode().is_none() {
            props = props.with_delivery_mode(2);
        }
        let exchange = s.names.tasks_exchange();
        let msg = amqp::Outgoing {
            exchange: &exchange,
            routing_key: Names::DEAD_KEY,
            body: &d.data,
            props,
        };
        let confirm = amqp::publish_batch(&s.publisher(), [msg])
            .await
            .into_iter()
            .next()
            .unwrap_or(Err(fleet::Error::BadAnswer {
                from: "publish_batch",
                detail: "no result for this publish".into(),
            }))?;
        amqp::confirmed(confirm).await
    }
}
