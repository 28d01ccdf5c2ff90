//! Trimming the task index (`fleet::status::index`): every [`PERIOD`], the index entries older
//! than the status TTL whose status record is gone are removed, at most [`STEP`] checked per
//! call and [`CALLS`] calls per tick (the walks of the task list remove the ones they meet,
//! too). Any number of replicas may run it: the step is idempotent. A Redis failure is logged
//! and the next tick tries again (the loop never ends the session).

use std::sync::Arc;
use std::time::Duration;

use fleet::process::Ticker;
use tokio_util::sync::CancellationToken;

use crate::session::Session;

/// How often the trim runs.
pub const PERIOD: Duration = Duration::from_secs(60);
/// Most entries one trim call checks.
pub const STEP: usize = 2000;
/// Most trim calls per tick.
pub const CALLS: usize = 50;

/// The trim loop of one session.
pub struct IndexTrim {
    pub session: Arc<Session>,
}

impl IndexTrim {
    /// Trims every [`PERIOD`] until shutdown; always `Ok`.
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(PERIOD);
        while ticker.tick(&shutdown).await {
            let s = &self.session;
            let ttl_ms = i64::try_from(s.cfg.common.status_ttl.as_millis()).unwrap_or(i64::MAX);
            let cutoff = s.store.clock.now_ms().saturating_sub(ttl_ms);
            for _ in 0..CALLS {
                match s.store.trim_task_index(cutoff, STEP).await {
                    // Done when a step removed less than it checked (the rest are alive) or
                    // found nothing old.
                    Ok((removed, checked)) if removed == 0 || removed < checked => break,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot trim the task index");
                        break;
                    }
                }
                if shutdown.is_cancelled() {
                    break;
                }
            }
        }
        Ok(())
    }
}
