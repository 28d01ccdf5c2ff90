//! Dispatch: turns a batch of deliveries into routed, parked, delayed or dead-lettered tasks.
//!
//! One batch = one reservation script call + pipelined publishes + one wait for all publisher
//! confirms + pipelined acks. A source message is acked only after everything it became is
//! confirmed by the broker; if any publish fails its reservation is given back and the source
//! message is requeued, so a task is never lost between two queues (at-least-once).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet::amqp::{self, DETAIL_HEADER, REASON_HEADER, TIER_HEADER};
use fleet::dedupe::Dedupe;
use fleet::route::{Reservation, ReserveParams, ReserveRequest};
use fleet::{delay, metrics as m, status, Envelope, Lane, Names};
use futures::future::join_all;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::PublisherConfirm;
use tokio_util::sync::CancellationToken;

use crate::session::Session;

/// Where a batch came from; decides gating, dedupe and what "no room" means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A producer's submission (the routing key's lane is authoritative).
    Ingress(Lane),
    /// Back from a delay tier (delayed start or retry backoff).
    Delayed,
    /// Released from a group's park queue: tasks that find no room stay held.
    Park,
    /// Released from the waiting-for-worker queue (no live group matched them yet — their
    /// selector, or their kind: see [`fleet::registry::Kinds`]): held until one does,
    /// dead-lettered `no_matching_worker` once the grace has passed.
    Unmatched,
}

/// The pseudo-group whose park queues hold tasks no live group matches yet
/// (`<ns>.park._unmatched.<lane>`): bounded, durable, counted as pending, nothing circles.
pub const UNMATCHED: &str = fleet::Names::UNMATCHED_GROUP;

/// What became of one delivery.
enum Fate {
    /// Publish to the group queue (reserved there).
    Dispatch(String),
    /// Publish to the group's park queue.
    Park(String),
    /// Publish to a delay tier (ms).
    Delay(u64),
    /// Publish to the dead-letter queue with its reason (the `x-fleet-reason` header and the
    /// status's `reason`) and a detail.
    Dead(status::DeadReason, String),
    /// Duplicate id: ack and drop.
    Duplicate,
    /// Stays unacked with the caller (park: no room yet).
    Hold,
}

/// The result of a batch: deliveries the caller keeps (park source), whether a park queue
/// refused a task (its bound reached: the ingress loop should pause), and whether publishes
/// failed (their sources were requeued).
#[derive(Default)]
pub struct Outcome {
    pub held: Vec<Delivery>,
    pub park_full: bool,
    pub dispatched: usize,
    /// Publishes not confirmed in this batch (their sources went back to their queue).
    pub failed: usize,
}

impl Outcome {
    /// Ends a consuming loop when its batch failed because the session's publishing channel
    /// is closed (the broker closed it alone, e.g. a 404 on a deleted exchange, while the
    /// connection stays up): every later publish would fail too and each requeued source
    /// would come straight back, a loop that dispatches nothing forever. The error ends the
    /// session, which opens a new publisher.
    ///
    /// # Errors
    /// `Other` naming the publisher, when `failed > 0` and it is closed.
    pub fn check_publisher(&self, session: &Session) -> fleet::Result<()> {
        if self.failed > 0 && !session.publisher.status().connected() {
            return Err(fleet::Error::Other(
                "the dispatch publisher channel is closed".into(),
            ));
        }
        Ok(())
    }
}

/// The pause a consuming loop takes after a batch whose publishes the broker refused (a nack,
/// unroutable, not confirmed), so their requeued sources are not taken straight back: 100 ms,
/// doubling per refused batch in a row to 5 s, reset by a batch with none refused. A nack
/// carries no reason — a queue at its bound and a quorum queue without a leader (mid-election,
/// for seconds after a node loss) look alike — and either way the same publish a moment later
/// fares no better (issue 37 item 3: ~400 refusals a second for 20 s in a tight requeue loop).
#[derive(Debug, Default)]
pub struct RefusalBackoff {
    next: Option<Duration>,
}

impl RefusalBackoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(5);

    /// The pause to take after `out`, `None` when nothing was refused (which resets it).
    pub fn after(&mut self, out: &Outcome) -> Option<Duration> {
        if out.failed == 0 {
            self.next = None;
            return None;
        }
        let wait = self.next.unwrap_or(Self::FIRST);
        self.next = Some((wait * 2).min(Self::MAX));
        Some(wait)
    }
}

/// The dispatch logic of one AMQP session, shared by every dispatching loop (ingress, delayed,
/// park release, orphan moves): what it publishes on and reads from is the [`Session`].
pub struct Dispatcher {
    pub session: Arc<Session>,
    /// Round-robin position over a sharded lane's shard queues (see [`Dispatcher::group_key`]).
    shard_rr: AtomicU32,
}

impl Dispatcher {
    pub fn new(session: Arc<Session>) -> Self {
        Dispatcher {
            session,
            shard_rr: AtomicU32::new(rand::random()),
        }
    }

    /// Routing key of the queue a task for `group`'s `lane` is published to. A sharded lane
    /// (`FLEET_SHARDS` > 1) takes its shards in turn (round robin, from a random start per
    /// process): every shard has a consumer while the group has a registered worker (see
    /// [`fleet::subset`]), so any shard will do, and turns spread the load evenly without
    /// reading queue depths on the hot path.
    pub fn group_key(&self, group: &str, lane: Lane) -> String {
        let shards = self.session.cfg.common.shards(lane);
        let shard = if shards > 1 {
            self.shard_rr.fetch_add(1, Ordering::Relaxed) % shards
        } else {
            0
        };
        self.session
            .names
            .group_shard_key(group, lane, shard, shards)
    }

    pub fn params(&self) -> ReserveParams {
        self.session.cfg.reserve_params()
    }

    /// Processes one batch. Cancel safe only in the sense that unacked deliveries return to
    /// the broker; callers do not cancel it mid-way except at shutdown.
    pub async fn process(
        &self,
        batch: Vec<Delivery>,
        source: &Source,
        shutdown: &CancellationToken,
    ) -> Outcome {
        let now = self.session.store.clock.now();
        // The size limit is the producer's, checked once on the producer's bytes; fleet's own
        // copies (delay, park hops) carry fleet's fields too and get the internal guard.
        let limits = match source {
            Source::Ingress(_) => self.session.cfg.common.limits,
            _ => self.session.cfg.common.limits.internal(),
        };
        let mut envs: Vec<Option<Envelope>> = Vec::with_capacity(batch.len());
        let mut fates: Vec<Option<Fate>> = Vec::with_capacity(batch.len());
        let mut to_route: Vec<usize> = Vec::new();
        // Submissions that are only checked against the dedupe marks (delayed or expired ones).
        let mut dedupe_first: Vec<usize> = Vec::new();

        for (i, d) in batch.iter().enumerate() {
            // A body without an id takes the AMQP `message_id` (how `POST /v1/tasks` passes
            // the id it answered with while publishing the producer's bytes unchanged).
            let message_id = match source {
                Source::Ingress(_) => d.properties.message_id().as_ref().map(|m| m.to_string()),
                _ => None,
            };
            // A dead-letter replay (`x-fleet-replay`) carries fleet's own fields from its first
            // pass: it is measured without them (`Envelope::fleet_fields_len`, bounded), so a
            // task that was under the producer's limit is under it again (`fleet::dead`).
            let replay = matches!(source, Source::Ingress(_))
                && amqp::header_text(&d.properties, fleet::headers::REPLAY).is_some();
            let parse_limits = if replay { limits.internal() } else { limits };
            let parsed = Envelope::parse_with_id(&d.data, &parse_limits, message_id.as_deref())
                .and_then(|e| {
                    let size = d.data.len().saturating_sub(e.fleet_fields_len());
                    if replay && size > limits.max_bytes {
                        return Err(fleet::envelope::Reject::Oversized {
                            size,
                            limit: limits.max_bytes,
                        });
                    }
                    Ok(e)
                })
                .and_then(|mut e| {
                    if let Source::Ingress(lane) = source {
                        e.lane = *lane;
                        // A deadline runs from submission: the producer's `submitted_at`, else the
                        // API's `x-fleet-submitted-at` header (ms), else the AMQP `timestamp`
                        // property (s), else now (first seen here).
                        if e.submitted_at.is_none() {
                            let header =
                                amqp::header_text(&d.properties, amqp::SUBMITTED_AT_HEADER)
                                    .and_then(|ms| fleet::headers::parse_submitted_at(&ms));
                            // The AMQP timestamp has whole seconds: it is taken only when the task
                            // evidently waited (2 s or more); a fresh one runs from now, so the
                            // truncation never takes up to a second off a short timeout.
                            let stamp = d
                                .properties
                                .timestamp()
                                .and_then(|t| i64::try_from(t).ok())
                                .and_then(|t| chrono::DateTime::from_timestamp(t, 0))
                                .filter(|t| now - *t >= chrono::Duration::seconds(2));
                            e.submitted_at = header.or(stamp);
                        }
                    }
                    e.normalize(now, self.session.cfg.common.default_max_attempts)?;
                    Ok(e)
                });
            match parsed {
                Err(r) => {
                    envs.push(None);
                    fates.push(Some(Fate::Dead(
                        status::DeadReason::from(&r),
                        r.to_string(),
                    )));
                }
                Ok(e) => {
                    if let Source::Ingress(lane) = source {
                        metrics::counter!(m::TASKS_SUBMITTED, "lane" => lane.as_str()).increment(1);
                    }
                    let fate = if e.is_expired(now) {
                        // A copy of a task already handed on (a redelivery, a resubmitted id)
                        // must not turn its true state into `expired`: checked like a delayed
                        // submission, it is a duplicate if the dedupe protocol says so.
                        if matches!(source, Source::Ingress(_)) {
                            dedupe_first.push(i);
                        }
                        Some(Fate::Dead(
                            status::DeadReason::Expired,
                            "deadline passed before dispatch".into(),
                        ))
                    } else if let Some(tier) = e
                        .not_before
                        .and_then(|nb| (nb - now).to_std().ok())
                        .and_then(delay::tier_for)
                    {
                        if matches!(source, Source::Ingress(_)) {
                            dedupe_first.push(i);
                        }
                        Some(Fate::Delay(tier))
                    } else {
                        to_route.push(i);
                        None
                    };
                    envs.push(Some(e));
                    fates.push(fate);
                }
            }
        }

        // Rate limit (opt-in): tokens first, one per task to route, per lane — before any slot
        // is reserved, so a throttled batch holds no leased room while it waits. (A task that
        // then turns out a duplicate or parks has spent its token: the limit errs safe.)
        for lane in Lane::ALL {
            let want = to_route
                .iter()
                .filter(|&&i| envs[i].as_ref().is_some_and(|e| e.lane == lane))
                .count() as u32;
            if want > 0 {
                self.take_tokens(lane, want, shutdown).await;
            }
        }

        // Dedupe (every submission, delayed and expired ones included: a delayed one is routed
        // without a check when due), route and reserve: one script call, retried while Redis is unreachable.
        let asked: Vec<usize> = dedupe_first.iter().chain(&to_route).copied().collect();
        if !asked.is_empty() {
            let reqs: Vec<ReserveRequest> = asked
                .iter()
                .filter_map(|&i| {
                    let e = envs[i].as_ref()?;
                    let dedupe = match source {
                        Source::Ingress(_) if batch[i].redelivered => Dedupe::Mark,
                        Source::Ingress(_) => Dedupe::Check,
                        _ => Dedupe::Skip,
                    };
                    Some(ReserveRequest {
                        id: e.id.clone(),
                        lane: e.lane,
                        selector: e.selector(),
                        kind: e.kind.clone(),
                        strategy: e.strategy,
                        dedupe,
                        from_park: *source == Source::Park,
                        dedupe_only: matches!(
                            fates[i],
                            Some(Fate::Delay(_)) | Some(Fate::Dead(status::DeadReason::Expired, _))
                        ),
                    })
                })
                .collect();
            // What each task is (kind, submitted_at), written with its status by the same call.
            let descs: Vec<fleet::route::TaskDescription> = asked
                .iter()
                .filter_map(|&i| {
                    let e = envs[i].as_ref()?;
                    Some(fleet::route::TaskDescription {
                        kind: e.kind.clone(),
                        submitted_at_ms: e.submitted_at.map(|t| t.timestamp_millis()),
                    })
                })
                .collect();
            let answers = match self.reserve_retrying(&reqs, &descs, shutdown).await {
                Some(a) => a,
                None => {
                    // Shutting down: leave everything unacked; the broker redelivers.
                    return Outcome {
                        held: vec![],
                        ..Default::default()
                    };
                }
            };
            for (&i, answer) in asked.iter().zip(answers) {
                let e = match envs[i].as_ref() {
                    Some(e) => e,
                    None => continue,
                };
                let age = (now - e.submitted_at.unwrap_or(now))
                    .to_std()
                    .unwrap_or_default();
                fates[i] = Some(match (answer, source) {
                    (Reservation::Fresh, _) => continue,
                    (Reservation::Failed(why), _) => {
                        Fate::Dead(status::DeadReason::InternalError, why)
                    }
                    (Reservation::Reserved(g), _) => Fate::Dispatch(g),
                    (Reservation::Duplicate, _) => Fate::Duplicate,
                    (Reservation::Full(_) | Reservation::NoMatch, Source::Park) => Fate::Hold,
                    (Reservation::NoMatch, Source::Unmatched)
                        if age < self.session.cfg.no_match_grace =>
                    {
                        Fate::Hold
                    }
                    (Reservation::Full(g), _) => Fate::Park(g),
                    (Reservation::NoMatch, _) if age >= self.session.cfg.no_match_grace => {
                        Fate::Dead(
                            status::DeadReason::NoMatchingWorker,
                            format!(
                                "no live worker satisfies {{{}}} and handles kind `{}`",
                                e.selector(),
                                e.kind
                            ),
                        )
                    }
                    // Waits, counted and bounded, until a matching worker registers.
                    (Reservation::NoMatch, _) => Fate::Park(UNMATCHED.to_string()),
                });
            }
        }

        self.publish_and_ack(batch, envs, fates, source).await
    }

    /// One reservation call for the batch, retried (same token) while Redis is unreachable.
    /// A script that fails on the batch (not a connection problem) is retried task by task, so
    /// one bad task never decides the fate of the others: the one that still fails alone is
    /// answered [`Reservation::Failed`] (dead-lettered `internal_error`). The batch token
    /// keeps the marks a failed call left behind from reading as duplicates. `None` once
    /// `shutdown` fires.
    async fn reserve_retrying(
        &self,
        reqs: &[ReserveRequest],
        descs: &[fleet::route::TaskDescription],
        shutdown: &CancellationToken,
    ) -> Option<Vec<Reservation>> {
        let mut backoff = Duration::from_millis(50);
        let params = self.params();
        loop {
            match self
                .session
                .store
                .reserve_described(reqs, descs, params)
                .await
            {
                Ok(a) if a.len() == reqs.len() => return Some(a),
                Ok(a) => tracing::error!(
                    got = a.len(),
                    want = reqs.len(),
                    "reserve returned a wrong count"
                ),
                Err(fleet::Error::Redis(e)) if is_script_error(&e) => {
                    metrics::counter!(m::REDIS_ERRORS).increment(1);
                    tracing::error!(error = %e, tasks = reqs.len(), "reserve script failed on a batch; retrying task by task");
                    let mut out = Vec::with_capacity(reqs.len());
                    for (j, r) in reqs.iter().enumerate() {
                        let d = descs.get(j).map(std::slice::from_ref).unwrap_or(&[]);
                        out.push(
                            match self
                                .session
                                .store
                                .reserve_described(std::slice::from_ref(r), d, params)
                                .await
                            {
                                Ok(mut a) if a.len() == 1 => a.remove(0),
                                Err(fleet::Error::Redis(e)) if is_script_error(&e) => {
                                    Reservation::Failed(e.to_string())
                                }
                                // Redis went away meanwhile: the whole batch again, later.
                                _ => break,
                            },
                        );
                    }
                    if out.len() == reqs.len() {
                        return Some(out);
                    }
                }
                Err(e) => {
                    metrics::counter!(m::REDIS_ERRORS).increment(1);
                    tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "reserve failed; retrying");
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }
}

/// A script that ran and failed (as opposed to a connection that failed): retrying the same
/// input would fail the same way.
fn is_script_error(e: &deadpool_redis::redis::RedisError) -> bool {
    !(e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || e.is_unrecoverable_error())
}

impl Dispatcher {
    async fn take_tokens(&self, lane: Lane, mut want: u32, shutdown: &CancellationToken) {
        let Some((rate, burst)) = self.session.cfg.rate_for(lane) else {
            return;
        };
        let mut throttled = false;
        while want > 0 {
            match self
                .session
                .store
                .take_tokens(lane, rate, burst, want)
                .await
            {
                Ok(g) => {
                    want -= g.granted.min(want);
                    if want == 0 {
                        break;
                    }
                    if !throttled {
                        metrics::counter!(m::DISPATCH_THROTTLED).increment(u64::from(want));
                        throttled = true;
                    }
                    let wait = Duration::from_millis(g.wait_ms.max(1));
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                Err(e) => {
                    // Without Redis the limiter fails open at its own rate: dispatch continues
                    // but paced, rather than stalling the fleet on a lost limiter.
                    metrics::counter!(m::REDIS_ERRORS).increment(1);
                    tracing::warn!(error = %e, "rate limiter unavailable; pacing locally");
                    let pace = Duration::from_secs_f64(f64::from(want) / rate);
                    tokio::time::sleep(pace.min(Duration::from_secs(1))).await;
                    return;
                }
            }
        }
    }

    async fn publish_and_ack(
        &self,
        batch: Vec<Delivery>,
        envs: Vec<Option<Envelope>>,
        fates: Vec<Option<Fate>>,
        source: &Source,
    ) -> Outcome {
        let mut out = Outcome::default();
        // 1. Start every publish, all together (one hand-off to the connection's I/O loop per
        // batch, not per task: see `amqp::publish_batch`). A park queue is declared first.
        let names = &self.session.names;
        let (tasks_x, delay_x) = (names.tasks_exchange(), names.delay_exchange());
        let mut pending: Vec<(usize, Option<PublisherConfirm>)> = Vec::with_capacity(batch.len());
        // Per publish: its delivery, exchange, routing key and body (the normalised envelope;
        // the producer's bytes for a refused one); its properties apart (moved into the publish).
        let mut heads: Vec<(usize, &str, String, Option<Vec<u8>>)> =
            Vec::with_capacity(batch.len());
        let mut props = Vec::with_capacity(batch.len());
        for (i, fate) in fates.iter().enumerate() {
            let Some(fate) = fate else { continue };
            let env = envs[i].as_ref();
            let id = env.map(|e| e.id.as_str()).unwrap_or("");
            let lane = env.map(|e| e.lane).unwrap_or_default();
            let (exchange, key, headers) = match fate {
                Fate::Dispatch(g) => (tasks_x.as_str(), self.group_key(g, lane), None),
                Fate::Park(g) => {
                    if let Err(e) = self.session.ensure_park(g, lane).await {
                        tracing::warn!(error = %e, group = %g, "cannot declare park queue");
                    }
                    (tasks_x.as_str(), names.park_key(g, lane), None)
                }
                Fate::Delay(tier) => (
                    delay_x.as_str(),
                    String::new(),
                    Some(amqp::headers([(TIER_HEADER, tier.to_string())])),
                ),
                Fate::Dead(reason, detail) => (
                    tasks_x.as_str(),
                    Names::DEAD_KEY.to_string(),
                    Some(amqp::headers([
                        (REASON_HEADER, reason.to_string()),
                        (DETAIL_HEADER, detail.clone()),
                    ])),
                ),
                Fate::Duplicate | Fate::Hold => {
                    pending.push((i, None));
                    continue;
                }
            };
            heads.push((i, exchange, key, env.map(Envelope::to_bytes)));
            props.push(amqp::task_properties(id, headers));
        }
        let msgs = heads
            .iter()
            .zip(props)
            .map(|((i, exchange, key, body), props)| amqp::Outgoing {
                exchange,
                routing_key: key,
                body: body.as_deref().unwrap_or(&batch[*i].data),
                props,
            });
        let sent = amqp::publish_batch(&self.session.publisher, msgs).await;
        for ((i, ..), r) in heads.iter().zip(sent) {
            match r {
                Ok(c) => pending.push((*i, Some(c))),
                Err(e) => {
                    // A missing confirm on a publishing fate marks it failed (step 3).
                    tracing::warn!(error = %e, "publish failed");
                    pending.push((*i, None));
                }
            }
        }
        // 2. Wait for all confirms.
        let idx: Vec<usize> = pending.iter().map(|(i, _)| *i).collect();
        let fates_ref = &fates;
        let results = join_all(pending.into_iter().map(|(i, c)| async move {
            match c {
                Some(c) => amqp::confirmed(c).await.map_err(|e| e.to_string()),
                None if matches!(fates_ref[i], Some(Fate::Duplicate) | Some(Fate::Hold)) => Ok(()),
                None => Err("publish not sent".to_string()),
            }
        }))
        .await;
        // 3. Ack what is safely elsewhere now; requeue the rest.
        let mut unreserve = Vec::new();
        let mut acks = Vec::new();
        let mut keep: HashSet<usize> = HashSet::new();
        let mut tally = Tally::default();
        for (i, r) in idx.into_iter().zip(results) {
            let fate = fates[i].as_ref();
            let env = envs[i].as_ref();
            match (r, fate) {
                (_, Some(Fate::Hold)) => {
                    keep.insert(i);
                }
                (Ok(()), Some(f)) => {
                    tally.count(f, env, &batch[i]);
                    acks.push(i);
                }
                (Err(e), f) => {
                    if let (Some(Fate::Dispatch(g)), Some(env)) = (f, env) {
                        unreserve.push((g.clone(), env.lane, env.id.clone()));
                    }
                    if matches!(f, Some(Fate::Park(_))) {
                        out.park_full = true;
                    }
                    out.failed += 1;
                    tracing::warn!(error = %e, "publish not confirmed; requeueing the source message");
                    let d = &batch[i];
                    let _ = d
                        .acker
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..Default::default()
                        })
                        .await;
                }
                (Ok(()), None) => {}
            }
        }
        tally.flush();
        if let Err(e) = self.session.store.unreserve(&unreserve).await {
            tracing::warn!(error = %e, "cannot give back reservations (their leases will expire)");
        }
        out.dispatched = fates
            .iter()
            .filter(|f| matches!(f, Some(Fate::Dispatch(_))))
            .count();
        if matches!(source, Source::Ingress(_)) {
            let handed: Vec<&str> = acks
                .iter()
                .filter_map(|&i| envs[i].as_ref().map(|e| e.id.as_str()))
                .collect();
            if let Err(e) = self.session.store.mark_handed_on(&handed).await {
                tracing::warn!(error = %e, "cannot mark submissions handed on (a redelivery could run them twice)");
            }
        }
        // A batch of a consuming loop that holds nothing back (ingress, delayed) is the run of
        // delivery tags since its previous batch, all settled: when every one is acked, one
        // `multiple` ack of the last tag does it.
        let whole =
            matches!(source, Source::Ingress(_) | Source::Delayed) && acks.len() == batch.len();
        let ack_results = if whole {
            match batch.iter().max_by_key(|d| d.delivery_tag) {
                Some(last) => vec![last.acker.ack(BasicAckOptions { multiple: true }).await],
                None => vec![],
            }
        } else {
            join_all(
                acks.iter()
                    .map(|&i| batch[i].acker.ack(BasicAckOptions::default())),
            )
            .await
        };
        for r in ack_results {
            if let Err(e) = r {
                tracing::warn!(error = %e, "ack failed (the message will be redelivered)");
            }
        }
        self.record_status(&fates, &envs, source).await;
        for (i, d) in batch.into_iter().enumerate() {
            if keep.contains(&i) {
                out.held.push(d);
            }
        }
        out
    }
}

/// A batch's dispatched and parked tasks per (group, lane), counted once per batch: a labelled
/// counter is a registry lookup (label hashing, a `String` for the group) per increment.
#[derive(Default)]
struct Tally {
    dispatched: std::collections::HashMap<(String, &'static str), u64>,
    parked: std::collections::HashMap<(String, &'static str), u64>,
}

/// The task id of a delivery whose envelope was refused: its `message_id` (set by fleet's
/// producers and the HTTP API), else a string `id` at the top of a JSON body; `None` when it
/// has neither (logged as `-`).
fn delivery_task_id(props: &lapin::BasicProperties, data: &[u8]) -> Option<String> {
    if let Some(id) = props.message_id() {
        return Some(id.to_string());
    }
    serde_json::from_slice::<serde_json::Value>(data)
        .ok()?
        .get("id")?
        .as_str()
        .map(str::to_string)
}

impl Tally {
    /// Counts `fate`; `d` is the delivery, whose task id is logged when no envelope could be
    /// read from it ([`delivery_task_id`]).
    fn count(&mut self, fate: &Fate, env: Option<&Envelope>, d: &Delivery) {
        let lane = env.map(|e| e.lane).unwrap_or_default().as_str();
        match fate {
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
                let id = env.map_or_else(
                    || delivery_task_id(&d.properties, &d.data),
                    |e| Some(e.id.clone()),
                );
                tracing::warn!(reason = reason.as_str(), detail = %detail, task.id = id.as_deref().unwrap_or("-"), "task dead-lettered");
            }
            Fate::Duplicate => metrics::counter!(m::TASKS_DUPLICATE).increment(1),
            Fate::Delay(_) | Fate::Hold => {}
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

impl Dispatcher {
    /// Status records for states decided here: expired or refused at the scheduler, and
    /// delayed submissions waiting for their `not_before` (the writers of `fleet::status`).
    async fn record_status(
        &self,
        fates: &[Option<Fate>],
        envs: &[Option<Envelope>],
        source: &Source,
    ) {
        let mut writes = status::Writes::new();
        for (f, e) in fates.iter().zip(envs) {
            match (f, e) {
                (Some(Fate::Dead(reason, detail)), Some(e)) => {
                    writes.ended(&e.id, e.lane, *reason, detail)
                }
                (Some(Fate::Park(g)), Some(e))
                    if g == UNMATCHED && *source != Source::Unmatched =>
                {
                    writes.waiting_for_worker(&e.id, e.lane)
                }
                (Some(Fate::Delay(_)), Some(e)) if matches!(source, Source::Ingress(_)) => {
                    writes.delayed(&e.id, e.lane, e.not_before)
                }
                _ => continue,
            }
            // What the task is, in the same HSET (no command of its own).
            if let Some(e) = e {
                writes.describe(&e.id, &e.kind, e.submitted_at);
            }
        }
        if let Err(err) = self
            .session
            .store
            .write_statuses(&writes, self.session.cfg.common.status_ttl)
            .await
        {
            tracing::debug!(error = %err, "cannot record status");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dead-lettered delivery is logged with its task id whenever it carries one (it was
    /// logged `task.id="?"` whenever the envelope could not be read).
    #[test]
    fn a_refused_delivery_is_logged_with_its_id() {
        let none = lapin::BasicProperties::default();
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

#[cfg(test)]
mod refusal_tests {
    use super::{Outcome, RefusalBackoff};
    use std::time::Duration;

    fn failed(n: usize) -> Outcome {
        Outcome {
            failed: n,
            ..Default::default()
        }
    }

    #[test]
    fn refused_batches_back_off_and_a_clean_batch_resets() {
        let mut b = RefusalBackoff::default();
        assert_eq!(b.after(&failed(0)), None);
        let waits: Vec<_> = (0..8)
            .map(|_| b.after(&failed(3)).unwrap_or_default())
            .collect();
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(b.after(&failed(0)), None);
        assert_eq!(b.after(&failed(1)), Some(Duration::from_millis(100)));
    }
}
