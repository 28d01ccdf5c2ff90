//! The batch's last step: publish every fate (a cancelled task's to `<ns>.cancelled`), wait
//! for all the confirms, then settle each delivery — acked once what it became is confirmed, requeued (its reservation given back)
//! when not, handed back to the caller when held — and write the statuses decided here.

use std::collections::HashMap;

use fleet::broker::amqp::{self, DETAIL_HEADER, REASON_HEADER};
use fleet::{metrics as m, status, Envelope, Names};
use futures::future::join_all;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::{BasicProperties, PublisherConfirm};

use super::{Dispatcher, Fate, Item, Orphan, Outcome, Source};

/// Where and how one item is published.
struct Plan<'a> {
    exchange: &'a str,
    key: String,
    /// `None`: the delivery's own bytes (a refused envelope, or a source that publishes as it
    /// came).
    body: Option<Vec<u8>>,
    /// Moved into the publish.
    props: BasicProperties,
}

/// How one item's publish stands after the batch was sent.
enum Sent {
    /// Nothing to publish (a duplicate, a held task, no fate).
    Nothing,
    /// Written; its confirm to await.
    Confirm(PublisherConfirm),
    /// Not written.
    Failed(fleet::Error),
}

impl Dispatcher {
    /// Publishes and settles a decided batch (see the module docs). Each item's fate is
    /// published to its queue; a fate without a publish (duplicate, hold) settles at once.
    pub(super) async fn publish_and_settle(
        &self,
        mut items: Vec<Item>,
        source: &Source,
        token: u64,
    ) -> Outcome {
        let mut out = Outcome::default();
        self.drop_cancelled_dead(&mut items, source).await;
        // 1. Start every publish, all together (one hand-off to the connection's I/O loop per
        // batch, not per task: see `amqp::publish_batch`). A park queue is declared first.
        let names = &self.session.names;
        let (tasks_x, delay_x) = (names.tasks_exchange(), names.delay_exchange());
        let mut plans: Vec<Option<Plan<'_>>> = Vec::with_capacity(items.len());
        for item in &items {
            plans.push(self.plan(item, source, &tasks_x, &delay_x).await);
        }
        let msgs = items
            .iter()
            .zip(plans.iter_mut())
            .filter_map(|(item, plan)| {
                let plan = plan.as_mut()?;
                let props = std::mem::take(&mut plan.props);
                let plan: &Plan<'_> = plan;
                Some(amqp::Outgoing {
                    exchange: plan.exchange,
                    routing_key: &plan.key,
                    body: plan.body.as_deref().unwrap_or(&item.delivery.data),
                    props,
                })
            });
        let mut written = amqp::publish_batch(&self.session.publisher(), msgs)
            .await
            .into_iter();
        let sent: Vec<Sent> = plans
            .iter()
            .map(|plan| match plan.as_ref().map(|_| written.next()) {
                None => Sent::Nothing,
                Some(Some(Ok(c))) => Sent::Confirm(c),
                Some(Some(Err(e))) => {
                    // A missing confirm on a publishing fate marks it failed (step 3).
                    tracing::warn!(error = %e, "publish failed");
                    Sent::Failed(e)
                }
                Some(None) => Sent::Failed(fleet::Error::BadAnswer {
                    from: "publish_batch",
                    detail: "no result for this publish".into(),
                }),
            })
            .collect();
        // Each item's target (`exchange/key`), for `Session::note_publishes`.
        let targets: Vec<Option<String>> = plans
            .iter()
            .map(|p| p.as_ref().map(|p| format!("{}/{}", p.exchange, p.key)))
            .collect();
        drop(plans);
        // 2. Wait for all confirms.
        let results = join_all(sent.into_iter().map(|s| async move {
            match s {
                Sent::Nothing => Ok(()),
                Sent::Confirm(c) => amqp::confirmed(c).await,
                Sent::Failed(e) => Err(e),
            }
        }))
        .await;
        // 3. Ack what is safely elsewhere now; requeue the rest.
        let mut unreserve = Vec::new();
        let mut acks: Vec<&Item> = Vec::new();
        let mut tally = Tally::default();
        // Publishes confirmed, and nacked by a queue with no bound to be at (all but the park
        // queues): the session renews a channel stuck nacking (`Session::note_publishes`).
        let mut reports: HashMap<&str, (usize, usize)> = HashMap::new();
        for ((item, r), target) in items.iter().zip(results).zip(&targets) {
            let report = target.as_deref().map(|t| reports.entry(t).or_default());
            match (r, &item.fate) {
                (_, Some(Fate::Hold)) => {}
                (Ok(()), Some(f)) => {
                    if let Some(rep) = report {
                        rep.0 += 1;
                    }
                    tally.count(f, item, source);
                    if matches!(f, Fate::Dispatch(_)) {
                        out.routed += 1;
                    }
                    acks.push(item);
                }
                (Err(e), f) => {
                    if let (Some(g), Some(env)) =
                        (f.as_ref().and_then(Fate::reserved), &item.envelope)
                    {
                        unreserve.push((g.to_string(), env.lane, env.id.clone(), env.key.clone()));
                    }
                    if matches!(f, Some(Fate::Park(_))) {
                        out.park_full = true;
                    } else if let Some(rep) = report.filter(|_| amqp::is_nack(&e)) {
                        rep.1 += 1;
                    }
                    out.failed += 1;
                    tracing::warn!(error = %e, "publish not confirmed; requeueing the source message");
                    let _ = item
                        .delivery
                        .acker
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..Default::default()
                        })
                        .await;
                    if out.error.is_none() {
                        out.error = Some(e);
                    }
                }
                (Ok(()), None) => {}
            }
        }
        tally.flush();
        self.session
            .note_publishes(reports.iter().map(|(t, (ok, no))| (*t, *ok, *no)))
            .await;
        if let Err(e) = self.session.store.unreserve_keyed(&unreserve).await {
            tracing::warn!(error = %e, "cannot give back reservations (their leases will expire)");
        }
        out.dispatched = items
            .iter()
            .filter(|i| matches!(i.fate, Some(Fate::Dispatch(_))))
            .count();
        if source.marks_handed_on() {
            // Every delivery of the batch acked: one flag for the batch's marks; else the
            // handed-on ids one by one (a nacked one must not read as handed on).
            let handed: Vec<&str> = if acks.len() == items.len() {
                Vec::new()
            } else {
                // A duplicate's mark is another submission's (maybe still in flight with a
                // crashed scheduler): marking it here would drop that one's redelivery.
                acks.iter()
                    .filter(|i| !matches!(i.fate, Some(Fate::Duplicate)))
                    .filter_map(|i| i.envelope.as_ref().map(|e| e.id.as_str()))
                    .collect()
            };
            let whole = (acks.len() == items.len()).then_some(token);
            if let Err(e) = self
                .session
                .store
                .mark_handed_on(
                    whole,
                    &handed,
                    self.session.cfg.dedupe_window.as_millis() as u64,
                )
                .await
            {
                tracing::warn!(error = %e, "cannot mark submissions handed on (a redelivery could run them twice)");
            }
        }
        // A batch of a consuming loop that holds nothing back (ingress, delayed) is the run of
        // delivery tags since its previous batch, all settled: when every one is acked, one
        // `multiple` ack of the last tag does it.
        let whole = source.acks_runs() && acks.len() == items.len();
        let ack_results = if whole {
            match items.iter().max_by_key(|i| i.delivery.delivery_tag) {
                Some(last) => vec![
                    last.delivery
                        .acker
                        .ack(BasicAckOptions { multiple: true })
                        .await,
                ],
                None => vec![],
            }
        } else {
            join_all(
                acks.iter()
                    .map(|i| i.delivery.acker.ack(BasicAckOptions::default())),
            )
            .await
        };
        // Acks in the order of `acks` unless one `multiple` ack did it.
        let each = !whole;
        for (k, r) in ack_results.into_iter().enumerate() {
            if let Err(e) = r {
                tracing::warn!(error = %e, "ack failed (the message will be redelivered)");
                if out.error.is_none() {
                    out.error = Some(e.into());
                }
                continue;
            }
            // An orphan counts as rerouted once the copy taken from its queue is acked.
            if let (Some(o), Some(item)) = (source.orphan(), acks.get(k).filter(|_| each)) {
                rerouted(o, item);
            }
        }
        self.record_status(&items, source).await;
        out.held = items
            .into_iter()
            .filter(|i| matches!(i.fate, Some(Fate::Hold)))
            .map(|i| i.delivery)
            .collect();
        out
    }

    /// Where and how `item` is published; `None` when its fate publishes nothing (or it has
    /// none). A park queue is declared here, once per session, before its first task.
    async fn plan<'a>(
        &self,
        item: &Item,
        source: &Source,
        tasks_x: &'a str,
        delay_x: &'a str,
    ) -> Option<Plan<'a>> {
        let names = &self.session.names;
        let env = item.envelope.as_ref();
        let lane = env.map(|e| e.lane).unwrap_or_default();
        let (exchange, key, headers) = match item.fate.as_ref()? {
            Fate::Dispatch(g) => (tasks_x, self.group_key(g, lane), None),
            Fate::Park(g) => {
                if let Err(e) = self.parks.ensure(g, lane).await {
                    tracing::warn!(error = %e, group = %g, "cannot declare park queue");
                }
                (tasks_x, names.park_key(g, lane), None)
            }
            Fate::Delay(tier) => (
                delay_x,
                String::new(),
                Some(amqp::headers(fleet::broker::delay::hop(
                    *tier,
                    self.session.store.clock.now_ms(),
                ))),
            ),
            Fate::Dead(reason, detail) => (
                tasks_x,
                Names::DEAD_KEY.to_string(),
                Some(amqp::headers([
                    (REASON_HEADER, reason.to_string()),
                    (DETAIL_HEADER, detail.clone()),
                ])),
            ),
            Fate::Back { .. } => (
                tasks_x,
                source.orphan().map_or_else(
                    || item.delivery.routing_key.as_str().to_string(),
                    |o| o.own_key.clone(),
                ),
                None,
            ),
            // Kept in `<ns>.cancelled` for a bulk retry (never dead-lettered); the delivery is
            // acked once the broker confirmed the copy, requeued when not.
            Fate::Cancelled => (
                tasks_x,
                Names::CANCELLED_KEY.to_string(),
                Some(amqp::headers([(
                    REASON_HEADER,
                    status::TaskState::Cancelled.as_str().to_string(),
                )])),
            ),
            Fate::Duplicate | Fate::Hold => return None,
        };
        Some(if source.verbatim() {
            // Properties as they came (message id, headers: a health probe stays one).
            Plan {
                exchange,
                key,
                body: None,
                props: item.delivery.properties.clone(),
            }
        } else {
            let id = env.map(|e| e.id.as_str()).unwrap_or("");
            Plan {
                exchange,
                key,
                body: env.map(Envelope::to_bytes),
                props: amqp::task_properties(id, headers),
            }
        })
    }

    /// Status records for states decided here ([`Source::writes_status`]): expired or refused
    /// at the scheduler, waiting for a worker, and delayed submissions waiting for their
    /// `not_before` (the writers of `fleet::status`). Nothing is written for a delivery with no
    /// envelope (no id to write under).
    async fn record_status(&self, items: &[Item], source: &Source) {
        let mut writes = status::Writes::new();
        for item in items {
            let (Some(f), Some(e)) = (&item.fate, &item.envelope) else {
                continue;
            };
            if !source.writes_status(f) {
                continue;
            }
            match f {
                Fate::Dead(reason, detail) => writes.ended(&e.id, e.lane, *reason, detail),
                Fate::Park(g) if crate::pause::hold_target(g).is_some() => {
                    writes.held(&e.id, e.lane, g)
                }
                Fate::Park(_) => writes.waiting_for_worker(&e.id, e.lane),
                Fate::Delay(_) => writes.delayed(&e.id, e.lane, e.not_before),
                _ => continue,
            }
            // What the task is, in the same HSET (no command of its own).
            writes.describe(
                &e.id,
                &e.kind,
                &e.selector().pairs().join(","),
                e.submitted_at,
            );
        }
        match self
            .session
            .store
            .write_statuses(&writes, self.session.cfg.common.status_ttl)
            .await
        {
            Ok(left) => {
                for (id, state) in left {
                    tracing::debug!(task.id = %fleet::task::escape(&id), state, "status left final");
                }
            }
            Err(err) => tracing::debug!(error = %err, "cannot record status"),
        }
    }

    /// A task an operator cancelled while it waited in a park, delay or waiting-for-worker
    /// queue, and which this batch would dead-letter (its deadline passed there, checked
    /// without a reservation call that reads the cancel), is dropped instead: a cancelled
    /// task is never dead-lettered (its message goes to `<ns>.cancelled`). One pipelined read
    /// of the dead fates' states, only in a batch that has some (dead fates are rare; nothing on the dispatch path). A submission
    /// (ingress) is left alone: a cancel needs a record, and a new run of a cancelled id is not
    /// the cancelled one. Redis unreachable: the fates stand (the status writer still keeps
    /// the record `cancelled`).
    async fn drop_cancelled_dead(&self, items: &mut [Item], source: &Source) {
        if matches!(source, Source::Ingress(_)) {
            return;
        }
        let dead: Vec<usize> = items
            .iter()
            .enumerate()
            .filter(|(_, i)| matches!(i.fate, Some(Fate::Dead(..))) && i.envelope.is_some())
            .map(|(k, _)| k)
            .collect();
        if dead.is_empty() {
            return;
        }
        let ids: Vec<&str> = dead
            .iter()
            .filter_map(|k| items[*k].envelope.as_ref().map(|e| e.id.as_str()))
            .collect();
        let states = match self.session.store.task_states(&ids).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the states of dead fates");
                return;
            }
        };
        for (k, state) in dead.into_iter().zip(states) {
            if state.as_deref() == Some(status::TaskState::Cancelled.as_str()) {
                items[k].fate = Some(Fate::Cancelled);
            }
        }
    }
}

/// A batch's dispatched and parked tasks per (group, lane), counted once per batch: a labelled
/// counter is a registry lookup (label hashing, a `String` for the group) per increment.
#[derive(Default)]
struct Tally {
    dispatched: HashMap<(String, &'static str), u64>,
    parked: HashMap<(String, &'static str), u64>,
}

impl Tally {
    /// Counts the confirmed `fate` of `item` from `source`; a delivery whose envelope could
    /// not be read is logged with the task id it carries ([`delivery_task_id`]).
    fn count(&mut self, fate: &Fate, item: &Item, source: &Source) {
        let env = item.envelope.as_ref();
        let lane = env.map(|e| e.lane).unwrap_or_default().as_str();
        match fate {
            // An orphan moved is rerouted, not dispatched again: counted once acked
            // ([`rerouted`]).
            Fate::Dispatch(_) if source.orphan().is_some() => {}
            Fate::Dispatch(g) => {
                *self.dispatched.entry((g.clone(), lane)).or_default() += 1;
                if let Some(e) = env {
                    tracing::debug!(task.id = %e.id, group = %g, lane, attempt = e.attempt, "dispatched");
                }
            }
            Fate::Park(g) => *self.parked.entry((g.clone(), lane)).or_default() += 1,
            Fate::Dead(status::DeadReason::Expired, _) => {
                metrics::counter!(m::TASKS_COMPLETED, "group" => "none", "lane" => lane, "outcome" => "expired").increment(1)
            }
            Fate::Dead(reason, detail) => {
                metrics::counter!(m::TASKS_REJECTED, "reason" => reason.as_str()).increment(1);
                let d = &item.delivery;
                let id = env.map_or_else(
                    || delivery_task_id(&d.properties, &d.data),
                    |e| Some(e.id.clone()),
                );
                tracing::warn!(reason = reason.as_str(), detail = %detail, task.id = id.as_deref().unwrap_or("-"), "task dead-lettered");
            }
            Fate::Duplicate => metrics::counter!(m::TASKS_DUPLICATE).increment(1),
            Fate::Cancelled => {
                metrics::counter!(m::TASKS_COMPLETED, "group" => "none", "lane" => lane, "outcome" => "cancelled").increment(1);
                if let Some(e) = env {
                    tracing::info!(task.id = %fleet::task::escape(&e.id), "a cancelled task reached: dropped, never dispatched");
                }
            }
            Fate::Delay(_) | Fate::Hold | Fate::Back { .. } => {}
        }
    }

    fn flush(self) {
        for ((group, lane), n) in self.dispatched {
            metrics::counter!(m::TASKS_DISPATCHED, "group" => group, "lane" => lane).increment(n);
        }
        for ((group, lane), n) in self.parked {
            metrics::counter!(m::TASKS_PARKED, "group" => group, "lane" => lane).increment(n);
        }
    }
}

/// Counts and logs an orphan moved to another group (`item`'s fate is [`Fate::Dispatch`]).
fn rerouted(o: &Orphan, item: &Item) {
    let Some(Fate::Dispatch(to)) = &item.fate else {
        return;
    };
    metrics::counter!(m::TASKS_REROUTED).increment(1);
    let id = item.envelope.as_ref().map_or("", |e| e.id.as_str());
    tracing::info!(task.id = %id, from = %o.group, to = %to, "orphaned task rerouted");
}

/// The task id of a delivery whose envelope was refused: its `message_id` (set by fleet's
/// producers and the HTTP API), else a string `id` at the top of a JSON body; `None` when it
/// has neither (logged as `-`).
fn delivery_task_id(props: &BasicProperties, data: &[u8]) -> Option<String> {
    if let Some(id) = props.message_id() {
        return Some(id.to_string());
    }
    serde_json::from_slice::<serde_json::Value>(data)
        .ok()?
        .get("id")?
        .as_str()
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead-lettered delivery is logged with its task id whenever it carries one (it was
    /// logged `task.id="?"` whenever the envelope could not be read).
    #[test]
    fn a_refused_delivery_is_logged_with_its_id() {
        let none = BasicProperties::default();
        let with_id = none.clone().with_message_id("m-1".into());
        // The message id first (fleet's producers and the API set it).
        assert_eq!(
            delivery_task_id(&with_id, br#"{"id":"body-1"}"#).as_deref(),
            Some("m-1")
        );
        // A JSON body's id (a refused envelope: no kind, a bad field).
        assert_eq!(
            delivery_task_id(&none, br#"{"id":"body-1","lane":"nope"}"#).as_deref(),
            Some("body-1")
        );
        // Neither: none.
        assert_eq!(delivery_task_id(&none, b"not json"), None);
        assert_eq!(delivery_task_id(&none, br#"{"id":7}"#), None);
    }
}
