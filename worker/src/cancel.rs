//! Cancels on the worker: the control stream `<ns>.control` ([`fleet::control`]) followed by
//! every worker, so a cancel reaches it at once — no heartbeat wait — and even when Redis lost
//! the mark.
//!
//! * A **run** of a cancelled task is stopped ([`CancelBoard::watch`] hands each run a token
//!   the follower cancels): `crate::attempt` drops a builtin handler's future (an http
//!   request with it) at once, and gives an exec run's process group SIGTERM, then SIGKILL
//!   after `FLEET_CANCEL_GRACE_MS` (`crate::executor::exec`). The attempt ends `cancelled`:
//!   never retried, never dead-lettered; its message is kept in `<ns>.cancelled` (confirmed)
//!   before the ack, for a bulk retry.
//! * A **copy** of a cancelled task reaching this worker is kept in `<ns>.cancelled` and
//!   acked without a claim ([`CancelBoard::cancel_of`]), its reservation given back — the backstop of `start.lua`'s
//!   own check while Redis is without the mark (after a loss, until a scheduler wrote it again).
//!
//! The follower reads the stream from its first record on every (re)connection, so a record
//! published while this worker was disconnected is still read. A worker that starts while
//! Redis is without the marks and before it has read the stream is the one gap left; the
//! schedulers close it within a second (`scheduler::control`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet::control::{Cancel, Cancels, Op, Reader};
use fleet::Names;
use tokio_util::sync::CancellationToken;

use crate::broker::Broker;

/// How long the follower waits before reading the stream again after a failure.
const RETRY: Duration = Duration::from_secs(1);
/// Records read between two prunes of the cancels older than the stream's retention.
const PRUNE_EVERY: u64 = 1024;

/// One run being watched: its submission time and the token its cancel fires.
struct Watched {
    key: u64,
    submitted_ms: Option<i64>,
    token: CancellationToken,
}

/// The cancels this worker knows and the runs they may stop. Cheap to share (`Arc`).
#[derive(Default)]
pub struct CancelBoard {
    cancels: Cancels,
    running: Mutex<HashMap<String, Vec<Watched>>>,
    next: AtomicU64,
}

impl CancelBoard {
    /// The cancel that applies to a copy of task `id` submitted at `submitted_ms` (Unix ms),
    /// if any (see [`Cancels::get`]).
    pub fn cancel_of(&self, id: &str, submitted_ms: Option<i64>) -> Option<Cancel> {
        self.cancels.get(id, submitted_ms)
    }

    /// The cancel that applies to a copy of `env`: its own, or its batch's as a whole
    /// ([`Cancels::get_batch`]: the backstop for a member whose own cancel record the
    /// accepting scheduler never appended).
    pub fn cancel_of_env(&self, env: &fleet::Envelope) -> Option<Cancel> {
        let submitted_ms = env.submitted_at.map(|t| t.timestamp_millis());
        self.cancels.get(&env.id, submitted_ms).or_else(|| {
            fleet::batch::batch_of(env).and_then(|b| self.cancels.get_batch(b, submitted_ms))
        })
    }

    /// Watches a run of task `id`: the returned guard's [`RunWatch::token`] is cancelled
    /// when a cancel of it arrives (at once if one is known). Dropping the guard ends the watch.
    pub fn watch(self: &Arc<Self>, id: &str, submitted_ms: Option<i64>) -> RunWatch {
        let token = CancellationToken::new();
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut m) = self.running.lock() {
            m.entry(id.to_string()).or_default().push(Watched {
                key,
                submitted_ms,
                token: token.clone(),
            });
        }
        if self.cancel_of(id, submitted_ms).is_some() {
            token.cancel();
        }
        RunWatch {
            board: self.clone(),
            id: id.to_string(),
            key,
            token,
        }
    }

    /// Takes in one record of the stream: remembers its cancel and stops the runs it cancels.
    /// Returns how many runs were told to stop.
    pub fn apply(&self, rec: &fleet::control::Record) -> usize {
        let Some(id) = self.cancels.apply(rec) else {
            return 0;
        };
        let Ok(m) = self.running.lock() else {
            return 0;
        };
        let mut stopped = 0;
        for w in m.get(&id).into_iter().flatten() {
            if self.cancels.get(&id, w.submitted_ms).is_some() && !w.token.is_cancelled() {
                w.token.cancel();
                stopped += 1;
            }
        }
        stopped
    }

    fn unwatch(&self, id: &str, key: u64) {
        if let Ok(mut m) = self.running.lock() {
            if let Some(v) = m.get_mut(id) {
                v.retain(|w| w.key != key);
                if v.is_empty() {
                    m.remove(id);
                }
            }
        }
    }
}

/// A run's watch ([`CancelBoard::watch`]); ends when dropped.
pub struct RunWatch {
    board: Arc<CancelBoard>,
    id: String,
    key: u64,
    /// Cancelled when the task is cancelled.
    pub token: CancellationToken,
}

impl Drop for RunWatch {
    fn drop(&mut self) {
        self.board.unwatch(&self.id, self.key);
    }
}

/// The loop that follows the control stream into a [`CancelBoard`], and drains this worker
/// when the stream records a drain of it.
pub struct Follower {
    pub broker: Arc<Broker>,
    pub names: Names,
    pub board: Arc<CancelBoard>,
    /// This worker: its id, when this process started (Unix ms: a drain recorded before it
    /// was another process's), and its drain switch.
    pub drain: Option<(String, i64, crate::drain::Control)>,
}

/// Whether `rec` is a drain of worker `id` recorded at or after `since_ms` (Unix ms).
pub fn drains(rec: &fleet::control::Record, id: &str, since_ms: i64) -> bool {
    match &rec.op {
        Op::Audit { action, target, .. } => {
            action == "drain"
                && target.get("worker").and_then(|w| w.as_str()) == Some(id)
                && rec.at_ms >= since_ms
        }
        _ => false,
    }
}

impl Follower {
    /// Reads the stream until `shutdown`, opening it again (from its first record) after any
    /// broker failure.
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            let conn = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                c = self.broker.connection() => c,
            };
            let Some(conn) = conn else { return };
            let mut read: u64 = 0;
            match Reader::open(&conn, &self.names).await {
                Ok(mut reader) => loop {
                    let r = tokio::select! {
                        biased;
                        _ = shutdown.cancelled() => {
                            reader.close().await;
                            return;
                        }
                        r = reader.next() => r,
                    };
                    // Each record is acted on in memory at once: ack as it comes.
                    let r = match r {
                        Ok(rec) => reader.ack().await.map(|()| rec),
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(Some(rec)) => {
                            read += 1;
                            if read.is_multiple_of(PRUNE_EVERY) {
                                // What the stream no longer keeps need not be remembered.
                                self.board.cancels.prune(
                                    fleet::redis::now_ms()
                                        - fleet::control::MAX_AGE.as_millis() as i64,
                                );
                            }
                            // A drain of this worker: the stream keeps it through a Redis loss
                            // that took the `draining` state before the heartbeat read it.
                            if let Some((id, since, control)) = &self.drain {
                                if drains(&rec, id, *since) {
                                    control.request_drain("drain recorded in the control stream");
                                }
                            }
                            let n = self.board.apply(&rec);
                            if let (true, Op::Cancel { task, by, .. }) = (n > 0, &rec.op) {
                                tracing::info!(task.id = %fleet::task::escape(task), by = %by, runs = n, "task cancelled: stopping its run");
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "control stream lost; reading it again");
                            break;
                        }
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open the control stream; trying again")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(RETRY) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet::control::Record;

    #[test]
    fn a_drain_record_drains_only_its_worker_and_only_a_later_process() {
        let who = fleet::settings::Caller::anonymous();
        let d = Record::audit(
            "drain",
            serde_json::json!({"worker": "w1"}),
            1,
            &who,
            "",
            1000,
        );
        assert!(drains(&d, "w1", 1000));
        assert!(
            !drains(&d, "w1", 1001),
            "recorded before this process started"
        );
        assert!(!drains(&d, "w2", 0));
        let other = Record::audit(
            "replay",
            serde_json::json!({"worker": "w1"}),
            1,
            &who,
            "",
            1000,
        );
        assert!(!drains(&other, "w1", 0));
    }

    #[test]
    fn a_cancel_stops_the_watched_runs_of_its_task_only() {
        let b = Arc::new(CancelBoard::default());
        let a = b.watch("a", Some(10));
        let later = b.watch("a", Some(5000));
        let other = b.watch("o", None);
        let admin = fleet::settings::Caller {
            name: "admin".into(),
            role: Some(fleet::settings::Role::Admin),
        };
        assert_eq!(b.apply(&Record::cancel("a", "why", &admin, 1000)), 1);
        assert!(a.token.is_cancelled());
        assert!(!later.token.is_cancelled(), "a later run of the id");
        assert!(!other.token.is_cancelled());
        // A run starting after the cancel is stopped at once.
        let again = b.watch("a", None);
        assert!(again.token.is_cancelled());
        drop((a, later, again));
        assert!(b.running.lock().unwrap().get("a").is_none());
        assert_eq!(
            b.cancel_of("a", Some(999)).map(|c| c.by),
            Some("admin".into())
        );
    }
}
