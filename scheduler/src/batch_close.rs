//! Batches over AMQP: the ingress's handling of a batch's **closing message** (see
//! [`fleet::batch`], "Over AMQP: the closing message").
//!
//! An ingress loop takes the deliveries whose AMQP `type` is [`fleet::batch::CLOSE_TYPE`] out
//! of each batch ([`Closes::take`]) before the rest is dispatched, and settles each one there
//! and then (so the batch's one `multiple` ack of the rest never covers a close):
//!
//! * a close that defines a batch ([`crate::batch_def::define`], [`Form::Close`]): its
//!   `BatchDef` record is appended to the control stream (publisher confirm), then the close
//!   is acked. Not confirmed: the close stays unacked in this loop's hands and is tried again
//!   after [`RETRY`], doubling to [`RETRY_MAX`] — never nacked back to its queue, where a
//!   quorum queue's delivery limit (20 by default on RabbitMQ 4) would drop it after a few
//!   seconds of broker trouble. A batch this replica already knows with the same members (a
//!   repeated close) is acked without a record.
//! * a close that defines nothing, or whose id is defined already with other members
//!   (`duplicate_batch_id`: a reused id; the first definition stands): published to the
//!   dead-letter queue with reason `bad_batch` and the refusal as detail (`<code>: <detail>
//!   (task <index>)`), the close's own bytes and properties kept; acked once the dead letter
//!   is confirmed, tried again like a record when not.
//!
//! A close costs the hot path one property comparison per delivery.

use std::sync::Arc;
use std::time::Duration;

use fleet::broker::amqp::{self, DETAIL_HEADER, REASON_HEADER};
use fleet::{metrics as m, status::DeadReason, Names};
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;

use crate::batch_def::{Ctx, Form};
use crate::session::Session;

/// The first pause after a close that could not be settled (its record or dead letter not
/// confirmed) before it is tried again; doubled per failure up to [`RETRY_MAX`].
pub const RETRY: Duration = Duration::from_millis(500);
/// The longest pause between two tries of one close.
pub const RETRY_MAX: Duration = Duration::from_secs(8);

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
    /// in order. A close not settled is tried again (backoff [`RETRY`] to [`RETRY_MAX`]) until
    /// it is, or until shutdown (then nothing is returned: every delivery of the batch stays
    /// unacked and comes again).
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
        for d in closes {
            // Held (unacked) and tried again until settled: never nacked back to its queue, where
            // a quorum queue's delivery limit (20 by default on RabbitMQ 4) would drop it after a
            // few seconds of broker trouble. Backoff 0.5 s doubling to 8 s; the rest of the batch
            // waits behind it (its broker is in trouble too). A shutdown leaves it unacked: the
            // broker gives it to the next consumer.
            let mut wait = RETRY;
            loop {
                let settled = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(Vec::new()),
                    settled = self.settle(&d) => settled,
                };
                match settled {
                    Ok(()) => {
                        if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
                            tracing::warn!(error = %e, "ack of a batch close failed (it will come again: a repeat changes nothing)");
                        }
                        break;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "a batch close was not settled (nothing confirmed); trying again");
                        if !self.session.publisher().status().connected() {
                            return Err(fleet::Error::ChannelClosed {
                                what: "batch close",
                            });
                        }
                        tokio::select! {
                            biased;
                            _ = shutdown.cancelled() => return Ok(Vec::new()),
                            _ = tokio::time::sleep(wait) => {}
                        }
                        wait = (wait * 2).min(RETRY_MAX);
                    }
                }
            }
        }
        Ok(rest)
    }

    /// Defines (or dead-letters) the batch of close `d`; `Err` when nothing was confirmed (the
    /// caller tries again).
    async fn settle(&self, d: &Delivery) -> fleet::Result<()> {
        let s = &self.session;
        let cfg = &s.cfg.common;
        let ctx = Ctx {
            limits: &cfg.limits,
            default_max_attempts: cfg.default_max_attempts,
            now: s.store.clock.now(),
            now_ms: s.store.clock.now_ms(),
            key: None,
        };
        let refused = match crate::batch_def::define(&d.data, Form::Close, &ctx) {
            Ok(def) => match crate::batch_def::conflict(&def, &self.batches) {
                Some(detail) => format!("duplicate_batch_id: {detail}"),
                None => {
                    let publisher = s.publisher();
                    let new = crate::batch_def::commit(
                        &def,
                        Some(&publisher),
                        &s.store,
                        &self.batches,
                        cfg.status_ttl,
                    )
                    .await?;
                    tracing::info!(batch = %def.batch, members = def.ids.len(), waiting = def.waiting.len(), new, "batch closed over AMQP");
                    return Ok(());
                }
            },
            Err(r) => r.line(),
        };
        self.dead_letter(d, &refused).await?;
        metrics::counter!(m::TASKS_REJECTED, "reason" => DeadReason::BadBatch.as_str())
            .increment(1);
        let batch = serde_json::from_slice::<serde_json::Value>(&d.data)
            .ok()
            .and_then(|v| v.get("id").and_then(|i| i.as_str()).map(str::to_string));
        tracing::warn!(reason = DeadReason::BadBatch.as_str(), detail = %refused, batch = batch.as_deref().unwrap_or("-"), "batch close dead-lettered");
        Ok(())
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
