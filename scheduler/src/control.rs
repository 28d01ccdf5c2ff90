//! The scheduler's side of the control stream ([`fleet::control`]): every replica follows
//! `<ns>.control`, keeps its cancels in Redis and its pauses in memory ([`crate::pause`]).
//!
//! **Pauses and the barrier.** On every session start the loop appends a barrier record of its
//! own ([`fleet::control::Op::Barrier`]) and folds the stream from its first record into a
//! fresh [`fleet::control::PauseSet`]; when it reads its barrier, everything before it has been
//! read: the fresh set replaces the one in force and `caught_up` turns true. The session's
//! dispatching loops start only then ([`crate::scheduler`]), so a restarted scheduler never
//! dispatches paused work. Later records are applied as they arrive; a resume of a group or
//! lane first sets that lane's parked flag, so new work queues behind what waited. Every
//! [`CHECK`] the loop appends again the record of a pause older than
//! [`fleet::control::RENEW_AFTER`] (half the stream's retention): a pause never ages out.
//!
//! **Key limits.** The `key_limit` records are folded the same way (a fresh
//! [`KeyOverrides`] per reading, swapped in at the barrier, then record by record) into the
//! limits in force over the settings' ([`Pauses::set_key_limits`], which dispatch reads); an
//! override in force is renewed like a pause.
//!
//! * Each record read is written as a cancel mark (`cancel.lua`, replay mode: idempotent; a
//!   mark the API already wrote is left as it is), so a cancel accepted while Redis failed
//!   still reaches it, through any replica.
//! * Every [`CHECK`] the loop asks whether Redis still holds the key that says "the marks are
//!   here" ([`fleet::Names::control_applied`]); gone — Redis restarted empty, or FLUSHALL — it
//!   writes every cancel it knows again, then sets the key. Between the loss and that rewrite
//!   (at most [`CHECK`] plus the rewrite) the workers' own memory of the stream refuses
//!   cancelled tasks (see `worker::cancel`), so no cancelled task runs meanwhile.
//!
//! One command per [`CHECK`] per replica; one script call per batch of records.

use std::sync::Arc;
use std::time::Duration;

use fleet::control::{AuditLog, Cancels, KeyOverrides, Mode, Op, PauseSet, Reader, Record, Target};
use fleet::{Lane, Store};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::pause::Pauses;

/// How often the loop checks whether Redis lost the marks.
pub const CHECK: Duration = Duration::from_secs(1);
/// How long a reader may take to reach its barrier before it is opened again (with a new
/// barrier): a reading of the whole stream (7 days of operator actions) takes well under it.
pub const CATCH_UP: Duration = Duration::from_secs(5);
/// Records written per script call.
const BATCH: usize = 256;

/// The loop that follows the control stream for one AMQP session.
pub struct ControlLoop {
    pub store: Store,
    pub conn: Arc<lapin::Connection>,
    pub cancels: Cancels,
    /// The audit log `GET /v1/audit` reads (kept across sessions: records are added once per id).
    pub audit: AuditLog,
    /// The status TTL: how long a mark lives in Redis.
    pub status_ttl: Duration,
    /// The process's pauses: replaced when the stream is read up to this session's barrier,
    /// then updated record by record.
    pub pauses: Pauses,
    /// Set to `true` once the stream is read up to this session's barrier.
    pub caught_up: watch::Sender<bool>,
    /// The batches folded from the stream ([`fleet::batch`]; kept across sessions).
    pub batches: fleet::batch::Batches,
}

impl ControlLoop {
    /// Follows the stream until `shutdown` (`Ok`) or a broker failure (`Err`: the session
    /// restarts and the reader starts again from the first record). A Redis failure is
    /// logged and tried again at the next record or check.
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let names = self.store.names.clone();
        let publisher = tokio::select! {
            p = fleet::broker::amqp::confirm_channel(&self.conn) => p?,
            _ = shutdown.cancelled() => return Ok(()),
        };
        let me = uuid::Uuid::new_v4().simple().to_string();
        // A batch not written (Redis failed): every mark is written again at the next check.
        let mut dirty = false;
        let mut tick = fleet::process::Ticker::new(CHECK);
        'read: loop {
            // The barrier first, then the reader from the first record: the reader never
            // attaches to an empty stream (a consumer attached to a fresh, empty stream was
            // seen to miss the records appended after it, its barrier included).
            let opened = async {
                let barrier = Record::barrier(&me, self.store.clock.now_ms());
                fleet::control::append(&publisher, &names, &barrier).await?;
                let reader = Reader::open(&self.conn, &names).await?;
                Ok::<_, fleet::Error>((reader, barrier.id))
            };
            let (mut reader, barrier) = tokio::select! {
                r = opened => r?,
                _ = shutdown.cancelled() => return Ok(()),
            };
            // The fold of this reading, until its barrier: then it replaces the set in force (a
            // set half rebuilt could resume what a later record paused again).
            let mut building: Option<(PauseSet, KeyOverrides, Vec<String>)> =
                Some(Default::default());
            let catch_up = tokio::time::sleep(CATCH_UP);
            tokio::pin!(catch_up);
            loop {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => {
                        reader.close().await;
                        return Ok(());
                    }
                    r = reader.next() => {
                        let mut recs: Vec<Record> = r?.into_iter().collect();
                        // What else has arrived already, in the same call.
                        while recs.len() < BATCH {
                            match tokio::time::timeout(Duration::from_millis(2), reader.next()).await {
                                Ok(r) => recs.extend(r?),
                                Err(_) => break,
                            }
                        }
                        reader.ack().await?;
                        for rec in &recs {
                            self.cancels.apply(rec);
                            self.audit.apply(rec);
                            self.batches.apply(rec);
                            match building.as_mut() {
                                Some((set, keys, ids)) => {
                                    set.apply(rec);
                                    keys.apply(rec);
                                    ids.push(rec.id.clone());
                                    if rec.id == barrier {
                                        if let Some((set, keys, ids)) = building.take() {
                                            tracing::info!(records = ids.len(), paused = set.all().count(), key_limits = keys.all().count(), "control stream read up to this session's barrier");
                                            self.pauses.replace_key_overrides(keys);
                                            self.pauses.replace(set, ids.iter().map(String::as_str));
                                        }
                                        self.caught_up.send_replace(true);
                                        self.audit.set_loaded();
                                    }
                                }
                                None => self.apply_live(rec).await,
                            }
                        }
                        if !self.write(&recs.iter().filter_map(mark).collect::<Vec<_>>()).await {
                            dirty = true;
                        }
                    }
                    _ = &mut catch_up, if building.is_some() => {
                        tracing::warn!(limit_ms = CATCH_UP.as_millis() as u64, "the control stream's reader did not reach its barrier in time; reading it again from the first record");
                        reader.close().await;
                        continue 'read;
                    }
                    _ = tick.next() => {
                        dirty = !self.check(dirty).await;
                        if building.is_none() {
                            self.renew(&publisher).await;
                        }
                    }
                }
            }
        }
    }

    /// Applies a record read after the barrier. A resume of a group or lane first sets the
    /// parked flag of each lane it opens (one command per lane, per resume): new work then
    /// queues behind the tasks that waited in its park queue instead of overtaking them.
    async fn apply_live(&self, rec: &Record) {
        if let Op::Resume { target, by } = &rec.op {
            let before = self.pauses.current();
            let (after, changed) = self.pauses.with(rec);
            if changed {
                let group = match target {
                    Target::Group { group } | Target::Lane { group, .. } => Some(group),
                    Target::Kind { .. } | Target::Key { .. } | Target::Batch { .. } => None,
                };
                for lane in Lane::ALL {
                    let Some(g) = group else { break };
                    if before.lane_paused(g, lane) && !after.lane_paused(g, lane) {
                        if let Err(e) = self
                            .store
                            .mark_parked(g, lane, fleet::route::park::FLAG_TTL_MS)
                            .await
                        {
                            tracing::debug!(error = %e, "cannot set the parked flag of a resumed lane");
                        }
                    }
                }
                tracing::info!(target = ?target, by = %by, "resumed");
            }
        } else if let Op::Pause { target, by, .. } = &rec.op {
            if self.pauses.current().get(target).is_none() {
                tracing::info!(target = ?target, by = %by, "paused");
            }
        } else if let Op::KeyLimit { key, spec, by, .. } = &rec.op {
            if self.pauses.apply_key_record(rec) {
                tracing::info!(key = key.as_deref().unwrap_or("*"), spec = ?spec, by = %by, "key limits changed");
            }
        }
        // Last: it answers the record's waiter (an API request), once everything is applied.
        self.pauses.apply(rec);
    }

    /// Appends again the record of every pause older than [`fleet::control::RENEW_AFTER`]
    /// (logged on failure, tried again at the next check).
    async fn renew(&self, publisher: &fleet::broker::amqp::Publisher) {
        let now = self.store.clock.now_ms();
        for p in self
            .pauses
            .current()
            .due_for_renewal(now, fleet::control::RENEW_AFTER)
        {
            let rec = Record::renewal(&p, now);
            match fleet::control::append(publisher, &self.store.names, &rec).await {
                Ok(()) => {
                    tracing::info!(target = ?p.target, "pause record renewed before the stream's retention drops it")
                }
                Err(e) => {
                    tracing::warn!(error = %e, target = ?p.target, "cannot renew a pause record (tried again in a second)")
                }
            }
        }
        for o in self
            .pauses
            .key_overrides()
            .due_for_renewal(now, fleet::control::RENEW_AFTER)
        {
            let rec = Record::key_limit_renewal(&o, now);
            let key = o.key.as_deref().unwrap_or("*");
            match fleet::control::append(publisher, &self.store.names, &rec).await {
                Ok(()) => {
                    tracing::info!(
                        key,
                        "key limit record renewed before the stream's retention drops it"
                    )
                }
                Err(e) => {
                    tracing::warn!(error = %e, key, "cannot renew a key limit record (tried again in a second)")
                }
            }
        }
    }

    /// Writes every mark again if Redis lost them (or `force`); `false` when Redis failed.
    async fn check(&self, force: bool) -> bool {
        let horizon = self.store.clock.now_ms() - fleet::control::MAX_AGE.as_millis() as i64;
        self.cancels.prune(horizon);
        self.audit.prune(horizon);
        self.batches.prune(horizon);
        match self.store.control_applied().await {
            Ok(true) if !force => true,
            Ok(_) => {
                let all: Vec<_> = self
                    .cancels
                    .all()
                    .into_iter()
                    .map(|(id, c)| (id, c.at_ms, c.by, c.reason))
                    .collect();
                if !all.is_empty() {
                    tracing::info!(cancels = all.len(), "Redis lost the cancel marks (restarted empty?): writing them again from the control stream");
                }
                if !self.write(&all).await {
                    return false;
                }
                match self.store.set_control_applied().await {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot set the control mark key");
                        false
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot check the control mark key");
                false
            }
        }
    }

    /// Writes cancel marks (replay mode); `false` when Redis failed.
    async fn write(&self, marks: &[(String, i64, String, String)]) -> bool {
        for chunk in marks.chunks(BATCH) {
            if let Err(e) = self
                .store
                .cancel(Mode::Replay, chunk, self.status_ttl)
                .await
            {
                tracing::warn!(error = %e, "cannot write cancel marks (tried again at the next check)");
                return false;
            }
        }
        true
    }
}

/// A record's cancel mark, `(id, at_ms, by, reason)`; `None` for other records.
fn mark(rec: &Record) -> Option<(String, i64, String, String)> {
    match &rec.op {
        fleet::control::Op::Cancel {
            task, reason, by, ..
        } => Some((task.clone(), rec.at_ms, by.clone(), reason.clone())),
        _ => None,
    }
}
