//! The batch's second step: rate-limit tokens for what is to be routed, then one reservation
//! script call for everything asked (`reserve.lua`: dedupe, choose a group, take leased room),
//! whose answers [`decide`] turns into fates.

use std::time::Duration;

use fleet::redis::Failure;
use fleet::route::{KeyArg, Reservation, ReserveRequest, Reserved, TaskDescription};
use fleet::{metrics as m, Lane};
use tokio_util::sync::CancellationToken;

use super::{decide, Dispatcher, Item, ReserveMode, Source};

/// What [`Dispatcher::reserve_and_decide`] returns: the one-try call's error, and each fairness
/// key's running + reserved after the call.
pub(super) type KeyedAnswer = (Option<fleet::Error>, Vec<(String, Option<u32>, bool)>);

impl Dispatcher {
    /// Rate limit (opt-in): tokens first, one per task to route, per lane — before any slot
    /// is reserved, so a throttled batch holds no leased room while it waits. (A task that
    /// then turns out a duplicate or parks has spent its token: the limit errs safe.)
    pub(super) async fn take_tokens_for(&self, items: &[Item], shutdown: &CancellationToken) {
        for lane in Lane::ALL {
            let want = items
                .iter()
                .filter(|i| i.to_route() && i.envelope.as_ref().is_some_and(|e| e.lane == lane))
                .count() as u32;
            if want > 0 {
                self.take_tokens(lane, want, shutdown).await;
            }
        }
    }

    /// Asks the reservation about every item with an [`Item::ask`] — the dedupe-only ones
    /// first, then those to route, in batch order — in one script call, and sets their fates
    /// ([`decide`]). Retried while Redis is unreachable when the source retries
    /// ([`Source::retries_reserve`]); otherwise a failed call answers every item
    /// [`Reservation::Failed`] and its error is returned.
    ///
    /// `None` once `shutdown` fires while retrying (nothing decided: the caller leaves the
    /// batch unacked); `Some((error, key_used))` otherwise, `error` being a one-try call's
    /// failure and `key_used` each fairness key's running + reserved after the call.
    pub(super) async fn reserve_and_decide(
        &self,
        items: &mut [Item],
        source: &Source,
        now: chrono::DateTime<chrono::Utc>,
        params: fleet::route::ReserveParams,
        shutdown: &CancellationToken,
    ) -> Option<KeyedAnswer> {
        // Dedupe (every submission, delayed and expired ones included: a delayed one is routed
        // without a check when due), route and reserve.
        let dedupe_only = |i: &&Item| i.ask == Some(ReserveMode::DedupeOnly);
        let asked = items
            .iter()
            .filter(dedupe_only)
            .chain(items.iter().filter(|i| i.to_route()));
        let mut reqs: Vec<ReserveRequest> = Vec::new();
        let mut descs: Vec<TaskDescription> = Vec::new();
        for item in asked {
            let (Some(e), Some(mode)) = (&item.envelope, item.ask) else {
                continue;
            };
            reqs.push(mode.request(e, source.dedupe(item.delivery.redelivered)));
            // What each task is (kind, submitted_at), written with its status by the same call.
            if source.describes() {
                descs.push(TaskDescription {
                    kind: e.kind.clone(),
                    submitted_at_ms: e.submitted_at.map(|t| t.timestamp_millis()),
                });
            }
        }
        if reqs.is_empty() {
            return Some((None, Vec::new()));
        }
        // Paused group lanes, told to the script with the batch (nothing when none is paused).
        let paused = self
            .session
            .pauses
            .snapshot()
            .map(|s| s.group_lanes())
            .unwrap_or_default();
        let (reserved, error) = if source.retries_reserve() {
            (
                self.reserve_retrying(&reqs, &descs, params, &paused, shutdown)
                    .await?,
                None,
            )
        } else {
            self.reserve_once(&reqs, &descs, params, &paused).await
        };
        if reserved.reclaimed > 0 {
            metrics::counter!(m::KEY_SLOTS_RECLAIMED).increment(reserved.reclaimed);
        }
        let answers = reserved.answers;
        let grace = self.session.cfg.no_match_grace;
        let mut answers = answers.into_iter();
        // The answers come in the order asked: the dedupe-only items, then those to route.
        for routing in [false, true] {
            let in_pass = |i: &&mut Item| {
                i.envelope.is_some()
                    && i.ask.is_some()
                    && (i.ask == Some(ReserveMode::DedupeOnly)) != routing
            };
            for item in items.iter_mut().filter(in_pass) {
                let (Some(answer), Some(e)) = (answers.next(), item.envelope.as_ref()) else {
                    break;
                };
                let age = (now - e.submitted_at.unwrap_or(now))
                    .to_std()
                    .unwrap_or_default();
                if let Some(fate) = decide(answer, source, e, age >= grace) {
                    item.fate = Some(fate);
                }
            }
        }
        Some((error, reserved.used))
    }

    /// One reservation call for `reqs`: the paused lanes, each key's limits in force and the
    /// fair queue count go with it (arguments: no command more).
    async fn reserve_call(
        &self,
        reqs: &[ReserveRequest],
        descs: &[TaskDescription],
        params: fleet::route::ReserveParams,
        paused: &[(String, Lane)],
    ) -> fleet::Result<Reserved> {
        let limits = self.session.pauses.key_limits();
        let pauses = self.session.pauses.snapshot();
        let keys = |k: &str| {
            let l = limits.for_key(k);
            KeyArg {
                max_running: l.max_running,
                rate: l.rate,
                paused: pauses.as_ref().is_some_and(|p| p.key_paused(k)),
            }
        };
        self.session
            .store
            .reserve_keyed(
                reqs,
                descs,
                params,
                paused,
                &keys,
                self.session.cfg.common.fair_queues,
            )
            .await
    }

    /// One reservation call, not retried: on failure (or a wrong count of answers) every
    /// request is answered [`Reservation::Failed`], with the call's error when it failed.
    async fn reserve_once(
        &self,
        reqs: &[ReserveRequest],
        descs: &[TaskDescription],
        params: fleet::route::ReserveParams,
        paused: &[(String, Lane)],
    ) -> (Reserved, Option<fleet::Error>) {
        let failed = |why: String| Reserved {
            answers: vec![Reservation::Failed(why); reqs.len()],
            ..Reserved::default()
        };
        match self.reserve_call(reqs, descs, params, paused).await {
            Ok(a) if a.answers.len() == reqs.len() => (a, None),
            Ok(a) => (
                failed(format!(
                    "reserve answered {} of {}",
                    a.answers.len(),
                    reqs.len()
                )),
                None,
            ),
            Err(e) => (failed(e.to_string()), Some(e)),
        }
    }

    /// One reservation call for the batch, retried (same token) while Redis is unreachable.
    /// A script that fails on the batch ([`Failure::Script`]: not a connection problem, a
    /// read-only replica or a refused write, which are retried whole) is retried task by task, so
    /// one bad task never decides the fate of the others: the one that still fails alone is
    /// answered [`Reservation::Failed`] (dead-lettered `internal_error`). The batch token
    /// keeps the marks a failed call left behind from reading as duplicates. `None` once
    /// `shutdown` fires.
    async fn reserve_retrying(
        &self,
        reqs: &[ReserveRequest],
        descs: &[TaskDescription],
        params: fleet::route::ReserveParams,
        paused: &[(String, Lane)],
        shutdown: &CancellationToken,
    ) -> Option<Reserved> {
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.reserve_call(reqs, descs, params, paused).await {
                Ok(a) if a.answers.len() == reqs.len() => return Some(a),
                Ok(a) => tracing::error!(
                    got = a.answers.len(),
                    want = reqs.len(),
                    "reserve returned a wrong count"
                ),
                Err(fleet::Error::Redis(e)) if Failure::of_redis(&e) == Failure::Script => {
                    metrics::counter!(m::REDIS_ERRORS).increment(1);
                    tracing::error!(error = %e, tasks = reqs.len(), "reserve script failed on a batch; retrying task by task");
                    let mut out = Vec::with_capacity(reqs.len());
                    for (j, r) in reqs.iter().enumerate() {
                        let d = descs.get(j).map(std::slice::from_ref).unwrap_or(&[]);
                        out.push(
                            match self
                                .reserve_call(std::slice::from_ref(r), d, params, paused)
                                .await
                            {
                                Ok(mut a) if a.answers.len() == 1 => a.answers.remove(0),
                                Err(fleet::Error::Redis(e))
                                    if Failure::of_redis(&e) == Failure::Script =>
                                {
                                    Reservation::Failed(e.to_string())
                                }
                                // Redis went away meanwhile: the whole batch again, later.
                                _ => break,
                            },
                        );
                    }
                    if out.len() == reqs.len() {
                        return Some(Reserved {
                            answers: out,
                            ..Reserved::default()
                        });
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

    /// Takes `want` tokens of `lane`'s rate limit (none when the lane has no limit), waiting
    /// for them as the limiter says; returns early at shutdown. Without Redis the limiter
    /// fails open at its own pace.
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
}
