//! The release loop of one park queue ([`Release`]): takes what the queue holds, in order, and
//! offers it to the reservation again until room frees — holding what still finds none, and
//! keeping its group's parked flag alive meanwhile.
//!
//! One loop per (group, lane) consumes the park queue and offers what it holds to the
//! reservation script again every `RETRY` until room frees (the reference design's trigger
//! loop). Held tasks stay unacked, so a scheduler crash returns them to the park queue.
//! While it holds tasks the loop keeps the group's "parked" flag alive, so new submissions
//! queue behind parked ones rather than overtaking them; once everything is on its way the
//! flag is cleared.

use std::sync::Arc;
use std::time::Duration;

use fleet::Lane;
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use super::fair::FairHold;
use super::UNMATCHED;
use crate::dispatch::{Dispatcher, Source};
use std::collections::{HashMap, HashSet};

/// How soon held tasks are offered again: from `RETRY_MIN`, doubling while nothing frees up,
/// up to `RETRY_MAX`. A busy group frees slots every few milliseconds; an idle wait costs
/// at most 20 reservation calls a second.
pub const RETRY_MIN: Duration = Duration::from_millis(2);
/// The longest pause between two offers of held tasks (see [`RETRY_MIN`]).
pub const RETRY_MAX: Duration = Duration::from_millis(50);
/// How often tasks waiting for a matching worker are offered again: a new worker's tasks
/// start within this, at 4 reservation calls a second per lane while any wait.
pub const UNMATCHED_RETRY: Duration = Duration::from_millis(250);
/// Most tasks a release loop holds out of its park queue: a batch, but never more than a
/// quarter of the queue's bound — held tasks are unacked and do not count against the bound,
/// which must mean what it says (the critical lane's is small on purpose). `batch_max` in
/// tasks (`FLEET_BATCH_MAX`), `bound` in messages (the lane's `park_max`); at least 1.
pub fn hold_max(batch_max: u16, bound: u32) -> u16 {
    let quarter = u16::try_from((bound / 4).max(1)).unwrap_or(u16::MAX);
    batch_max.min(quarter)
}

/// The release loop of one park queue.
pub struct Release {
    /// The dispatcher its batches go through (as [`Source::Park`], or [`Source::Unmatched`]
    /// for the waiting-for-worker queue).
    pub d: Arc<Dispatcher>,
    /// The group whose park queue it consumes ([`UNMATCHED`]: the waiting-for-worker queue).
    pub group: String,
    /// The lane of the park queue.
    pub lane: Lane,
}

impl Release {
    /// Consumes the park queue until `shutdown` (the session's end, or the group's reclaim)
    /// fires; then closes its channel, so tasks it held go back to the queue at once.
    ///
    /// # Errors
    /// The channel cannot be opened or the consume fails; the queue's consumer was cancelled
    /// while its group still exists; a batch failed on a closed publisher
    /// ([`crate::dispatch::Outcome::check_publisher`]). The caller ends the session.
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let Release { d, group, lane } = self;
        let queue = d.session.names.park_queue(&group, lane);
        let mut changes = d.session.pauses.subscribe();
        loop {
            // A paused lane (or kind, for a hold queue) consumes nothing: its tasks stay in the
            // broker, in order, until the resume.
            changes.borrow_and_update();
            while paused(&d, &group, lane) {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return Ok(()),
                    r = changes.changed() => if r.is_err() { return Ok(()) },
                }
            }
            let ch = d.session.conn.create_channel().await?;
            let r = consume(&d, &ch, &queue, &group, lane, &shutdown, &mut changes).await;
            let _ = ch.close(200, "ok".into()).await;
            return match r? {
                Ended::Shutdown => Ok(()),
                // What it held went back to the queue with the channel.
                Ended::Paused => {
                    tracing::info!(queue = %queue, "paused: releasing nothing until the resume");
                    continue;
                }
                // The queue was deleted under the consumer: the group was reclaimed (by
                // another scheduler replica, or while this loop was being stopped). Not a
                // session failure. (Asked of Redis now, not of the fleet view: the view may
                // predate the reclaim.) A hold queue has no group in Redis.
                Ended::ConsumerCancelled
                    if crate::pause::hold_target(&group).is_some()
                        || !d.session.store.group_names().await?.contains(&group) =>
                {
                    tracing::info!(queue = %queue, "park queue deleted: its group was reclaimed");
                    Ok(())
                }
                Ended::ConsumerCancelled => Err(fleet::Error::ConsumerEnded {
                    queue: queue.to_string(),
                }),
                // Only this loop ends: discovery starts it again on its next pass (the group is
                // still in the view), on a fresh channel.
                Ended::ChannelClosed => {
                    tracing::warn!(queue = %queue, "the broker closed this park loop's channel (its consumer timeout?); the loop starts again");
                    Ok(())
                }
            };
        }
    }
}

/// Whether the park queue of `group`'s `lane` is paused: the lane of a group, or the kind or
/// batch of a hold queue ([`crate::pause::hold_target`]). The waiting-for-worker queue never is.
fn paused(d: &Dispatcher, group: &str, lane: Lane) -> bool {
    let pauses = &d.session.pauses;
    match crate::pause::hold_target(group) {
        Some(hold) => pauses.current().get(&hold).is_some(),
        None => pauses.lane_paused(group, lane),
    }
}

/// Why [`consume`] returned.
enum Ended {
    Shutdown,
    /// Its lane (or kind) was paused: the loop closes its channel and waits for the resume.
    Paused,
    /// The broker ended the consumer (its queue was deleted).
    ConsumerCancelled,
    /// The broker closed the loop's channel (e.g. its consumer timeout, while a full group held
    /// tasks here longer): what the loop held is back in the queue.
    ChannelClosed,
}

async fn consume(
    d: &Dispatcher,
    ch: &lapin::Channel,
    queue: &str,
    group: &str,
    lane: Lane,
    shutdown: &CancellationToken,
    changes: &mut tokio::sync::watch::Receiver<u64>,
) -> fleet::Result<Ended> {
    let hold_max = hold_max(d.session.cfg.batch_max, d.session.cfg.common.park_max[lane]);
    // Per consumer (`global` false): each park queue of the loop has its own window.
    ch.basic_qos(hold_max, BasicQosOptions::default()).await?;
    let first = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut consumers = futures::stream::select_all([first]);
    let mut held = FairHold::default();
    let mut used: HashMap<String, u32> = HashMap::new();
    // Keys that held their own tasks back in the last batch: offered one task (a probe) each.
    let mut blocked: HashSet<String> = HashSet::new();
    let mut last_dispatched = usize::from(hold_max);
    let mut retry = RETRY_MIN;
    // The waiting-for-worker queue is a park queue of no group: its tasks take no group's
    // room ahead of others, and no group's "parked" flag is kept for them.
    let unmatched = group == UNMATCHED;
    // A kind's or batch's hold queue ([`crate::pause`]) is offered as the delayed queue is:
    // routed, and parked behind its group when that is full. It keeps no group's flag either.
    let hold_queue = crate::pause::hold_target(group).is_some();
    let source = if unmatched {
        Source::Unmatched
    } else if hold_queue {
        Source::Delayed
    } else {
        Source::Park
    };
    let unmatched = unmatched || hold_queue;
    // A group's normal lane also releases its fair park queues ([`super::fair`]): consumed
    // from when `reserve.lua` first assigns one to a waiting key (looked up every
    // `FAIR_LOOKUP` while the loop runs).
    let max_fair = if lane == Lane::Normal && !unmatched {
        d.session.cfg.common.fair_queues
    } else {
        0
    };
    let mut fair = 0u16;
    let mut looked = tokio::time::Instant::now() - FAIR_LOOKUP;
    // When the broker was last asked which fair queues exist (`None`: not yet; the first
    // lookup asks), and Redis's count at the last lookup (a count that falls — Redis lost it,
    // or it lapsed unused — makes the next lookup ask the broker too).
    let mut probed: Option<tokio::time::Instant> = None;
    let mut last_count = 0u16;
    // This session's first declare of a fair queue (a key just parked in one) is looked up
    // at once.
    let mut fair_news = d.parks().fair_declared();
    let share = super::HeldShare::new(&d.session.parks_held, group, lane);
    loop {
        share.set(held.len());
        // With a full hold the consumer is not polled, so its end would go unseen: a channel
        // the broker closed (its consumer timeout, while a full group held tasks here longer)
        // has handed them back to the queue, and acking them here can only fail.
        if !ch.status().connected() {
            return Ok(Ended::ChannelClosed);
        }
        if paused(d, group, lane) {
            return Ok(Ended::Paused);
        }
        if fair < max_fair && fair_news.has_changed().unwrap_or(false) {
            fair_news.borrow_and_update();
            looked = tokio::time::Instant::now() - FAIR_LOOKUP;
        }
        if fair < max_fair && looked.elapsed() >= FAIR_LOOKUP {
            looked = tokio::time::Instant::now();
            let due = probed.is_none_or(|t| t.elapsed() >= FAIR_PROBE);
            let (have, count) = add_fair_queues(
                d,
                ch,
                group,
                (fair, max_fair),
                (due, last_count),
                &mut consumers,
            )
            .await?;
            if due || count < last_count {
                probed = Some(looked);
            }
            (fair, last_count) = (have, count);
        }
        if held.is_empty() {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(Ended::Shutdown),
                // A pause (or any change of the pauses) is looked at from the top.
                r = changes.changed() => {
                    if r.is_err() {
                        return Ok(Ended::Shutdown);
                    }
                    continue;
                }
                n = consumers.next() => n,
                // New fair queues are looked up while nothing is held, too.
                _ = tokio::time::sleep(FAIR_LOOKUP), if fair < max_fair => continue,
                _ = fair_news.changed(), if fair < max_fair => continue,
            };
            match next {
                Some(Ok(dl)) => held.push(dl),
                Some(Err(e)) => return Err(e.into()),
                None => return Ok(Ended::ConsumerCancelled),
            }
        }
        let mut drained = false;
        let window = usize::from(hold_max) * (1 + usize::from(fair));
        while held.len() < window {
            match consumers.next().now_or_never() {
                Some(Some(Ok(dl))) => held.push(dl),
                Some(Some(Err(e))) => return Err(e.into()),
                _ => {
                    drained = true;
                    break;
                }
            }
        }
        let limits = d.session.pauses.key_limits();
        // Keys with a guaranteed share and tasks held: their running + reserved read fresh
        // (a finished run gives its slot back without this loop seeing it).
        let floors: Vec<String> = held
            .keys()
            .filter(|k| limits.for_key(k).min_running > 0)
            .map(str::to_string)
            .collect();
        if !floors.is_empty() {
            let ks: Vec<&str> = floors.iter().map(String::as_str).collect();
            let now = d.session.store.clock.now_ms();
            if let Ok(counts) = d.session.store.key_used(&ks, now).await {
                for (k, n) in floors.iter().zip(counts) {
                    used.insert(k.clone(), n);
                }
            }
        }
        // Offered: about what the group took last time, doubled (at least 16): the fair order's
        // head, not the whole window — a batch costs a parse and a script pass per task, and a
        // short batch is a short cycle, so freed slots are handed out sooner.
        let want = (2 * last_dispatched + 16).min(usize::from(hold_max));
        let batch = held.batch(want, &limits, &used, &blocked);
        let offered = batch.len();
        let out = d.process(batch, &source, shutdown).await;
        last_dispatched = out.dispatched;
        out.check_publisher(&d.session)?;
        for (k, u, b) in &out.key_used {
            if let Some(u) = u {
                used.insert(k.clone(), *u);
            }
            if *b {
                blocked.insert(k.clone());
            } else {
                blocked.remove(k);
            }
        }
        tracing::debug!(
            group,
            offered,
            dispatched = out.dispatched,
            held = held.len() + out.held.len(),
            blocked = blocked.len(),
            "fair release batch"
        );
        // A publish that failed (e.g. the target park queue at its bound) requeued its source,
        // which comes straight back: wait as for a held task rather than spin on it.
        let refused = out.failed > 0;
        held.put_back(out.held, &limits);
        share.set(held.len());
        if held.is_empty() && drained && !refused && !unmatched {
            // Everything parked here is on its way: new work may take room directly again.
            if let Err(e) = d.session.store.clear_parked(group, lane).await {
                tracing::debug!(error = %e, "cannot clear parked flag");
            }
        }
        // `dispatched` counts decisions; a refused publish backs off like a held task.
        retry = if out.dispatched > 0 && !refused {
            RETRY_MIN
        } else {
            (retry * 2).min(RETRY_MAX)
        };
        if !held.is_empty() || refused {
            // A key held back by its rate gets its next token within half its interval: a
            // longer pause would waste tokens past the bucket's size.
            if let Some(pace) = held
                .keys()
                .filter_map(|k| limits.for_key(k).rate.map(|(r, _)| r))
                .map(|r| Duration::from_secs_f64(0.5 / r.max(0.001)))
                .min()
            {
                retry = retry.min(pace.max(RETRY_MIN));
            }
            if unmatched {
                // Nothing frees room here; a worker registering does. Ask a few times a second.
                retry = UNMATCHED_RETRY;
            } else if let Err(e) = d
                .session
                .store
                .mark_parked(group, lane, fleet::route::park::FLAG_TTL_MS)
                .await
            {
                tracing::debug!(error = %e, "cannot renew parked flag");
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(Ended::Shutdown),
                // A raised key limit (or a resume) is tried at once.
                r = changes.changed() => if r.is_err() { return Ok(Ended::Shutdown) },
                _ = tokio::time::sleep(retry) => {}
            }
        }
    }
}

/// How often a group's release loop asks the broker which of its fair park queues exist,
/// besides at its first lookup and after Redis's count of them fell: that count is state
/// that may be lost. Each ask is a passive declare of the next queue (on the session's
/// prober), which the broker answers 404 (closing the channel, a line in its log) while no
/// further queue exists: rare on purpose.
const FAIR_PROBE: Duration = Duration::from_secs(300);

/// How often a group's release loop looks up how many fair park queues its keys use.
const FAIR_LOOKUP: Duration = Duration::from_millis(500);

/// Starts consuming the fair park queues of `group` that `reserve.lua` has assigned beyond
/// the first `have` (at most `max`) — as Redis counts them, and, when `due` or when Redis's
/// count fell below `last_count` (the count at the previous lookup), as the broker has them
/// (the queues that exist: a prefix `~k0..`, found by passive declares). Returns how many
/// are consumed now and Redis's count read (`last_count` when Redis did not answer).
///
/// # Errors
/// The declare or the consume failed (the loop's channel is gone: the loop starts again).
async fn add_fair_queues(
    d: &Dispatcher,
    ch: &lapin::Channel,
    group: &str,
    (have, max): (u16, u16),
    (due, last_count): (bool, u16),
    consumers: &mut futures::stream::SelectAll<lapin::Consumer>,
) -> fleet::Result<(u16, u16)> {
    let names = &d.session.names;
    let (mut assigned, count) = match d
        .session
        .store
        .fair_queues_assigned(group, Lane::Normal)
        .await
    {
        Ok(n) => (n.min(max), n.min(max)),
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the fair queues assigned");
            if !due {
                return Ok((have, last_count));
            }
            (have, last_count)
        }
    };
    if due || count < last_count {
        // Redis's count may be gone (a FLUSHALL, a failover) while tasks still wait in fair
        // queues it assigned: a loop started after that would never consume them. The queues
        // are assigned in order from 0, so those that exist are a prefix: asked of the broker
        // one by one (a passive declare each) past what Redis says.
        // On the session's prober, not the session connection: the ask past the last queue
        // is answered 404, which would cost the session connection a channel id for good
        // (fleet::broker::probe) — one per group every FAIR_PROBE, a session restart after
        // some hours for a fleet of a few dozen groups.
        let mut q = assigned.max(have);
        while q < max
            && matches!(
                d.session
                    .probe
                    .queue(&names.park_queue(&fleet::Names::fair_group(group, q), Lane::Normal))
                    .await,
                Ok(Some(_))
            )
        {
            q += 1;
        }
        if q > assigned.max(have) {
            tracing::info!(
                group,
                redis = assigned,
                broker = q,
                "fair park queues found in the broker beyond Redis's count (Redis lost it?): consuming them"
            );
        }
        assigned = q;
    }
    for q in have..assigned {
        let pseudo = fleet::Names::fair_group(group, q);
        d.parks().ensure(&pseudo, Lane::Normal).await?;
        let c = ch
            .basic_consume(
                names.park_queue(&pseudo, Lane::Normal).as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        consumers.push(c);
    }
    Ok((assigned.max(have), count))
}
