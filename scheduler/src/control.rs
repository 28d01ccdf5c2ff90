//! The scheduler's side of the control stream ([`fleet::control`]): every replica follows
//! `<ns>.control` and keeps its cancels in Redis.
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

use fleet::control::{AuditLog, Cancels, Mode, Reader, Record};
use fleet::Store;
use tokio_util::sync::CancellationToken;

/// How often the loop checks whether Redis lost the marks.
pub const CHECK: Duration = Duration::from_secs(1);
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
}

impl ControlLoop {
    /// Follows the stream until `shutdown` (`Ok`) or a broker failure (`Err`: the session
    /// restarts and the reader starts again from the first record). A Redis failure is
    /// logged and tried again at the next record or check.
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut reader = tokio::select! {
            r = Reader::open(&self.conn, &self.store.names) => r?,
            _ = shutdown.cancelled() => return Ok(()),
        };
        let mut tick = fleet::process::Ticker::new(CHECK);
        // A batch not written (Redis failed): every mark is written again at the next check.
        let mut dirty = false;
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
                    }
                    if !self.write(&recs.iter().filter_map(mark).collect::<Vec<_>>()).await {
                        dirty = true;
                    }
                }
                _ = tick.next() => dirty = !self.check(dirty).await,
            }
        }
    }

    /// Writes every mark again if Redis lost them (or `force`); `false` when Redis failed.
    async fn check(&self, force: bool) -> bool {
        let horizon = self.store.clock.now_ms() - fleet::control::MAX_AGE.as_millis() as i64;
        self.cancels.prune(horizon);
        self.audit.prune(horizon);
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
