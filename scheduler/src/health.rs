//! The health checker: evicts silent workers.
//!
//! Every `health_interval`, workers whose last heartbeat is older than `heartbeat_timeout` are
//! removed by one idempotent script — capacity out of their group, running records released —
//! so any number of scheduler replicas may run it. Their unacked tasks come back from the
//! broker when their connection dies.
//!
//! After each eviction check the loop hands the orphaned groups' tasks to the orphan rescue
//! ([`crate::dispatch::rescue`]), on a view sampled after the eviction: a group whose workers
//! were just evicted is already seen without them.

use std::sync::Arc;
use std::time::Instant;

use fleet::metrics as m;
use fleet::process::Ticker;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{rescue, Dispatcher};
use crate::session::Session;
use crate::view::ViewRx;

/// The health checker's loop: eviction, then orphan rescue, every `health_interval`.
/// Eviction is a script on the present state; orphan rescue ([`rescue::rescue_orphans`]) reads
/// the groups and queue depths of the [fleet view](crate::view) — one sampled after the
/// eviction, so an evicted worker's group is already seen without it — and moves tasks through
/// the dispatcher (a reservation per task).
pub struct HealthCheck {
    /// The session whose store the eviction script runs on.
    pub session: Arc<Session>,
    /// The dispatcher the orphan rescue moves tasks through.
    pub dispatcher: Arc<Dispatcher>,
    /// The fleet view the rescue reads.
    pub view: ViewRx,
}

impl HealthCheck {
    /// Ticks every `health_interval` until `shutdown`.
    ///
    /// # Errors
    /// The view loop is gone (the session is ending).
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(self.session.cfg.health_interval);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick(&shutdown).await?,
            }
        }
        Ok(())
    }

    /// One tick. `Err` only when the view loop is gone (the session is ending).
    async fn tick(&mut self, shutdown: &CancellationToken) -> fleet::Result<()> {
        let (s, cfg) = (&self.session, &self.session.cfg);
        // Eviction is one script on the present state (not the fleet view): idempotent, and
        // safe for any number of replicas.
        match s.store.evict_stale(cfg.heartbeat_timeout).await {
            Ok(ids) => {
                for id in &ids {
                    tracing::warn!(worker = %id, timeout_ms = cfg.heartbeat_timeout.as_millis() as u64, "worker evicted: no heartbeat");
                }
                metrics::counter!(m::WORKER_EVICTIONS).increment(ids.len() as u64);
            }
            Err(e) => {
                metrics::counter!(m::REDIS_ERRORS).increment(1);
                tracing::warn!(error = %e, "eviction check failed");
            }
        }
        // A view sampled after the eviction (none while Redis is unreadable: no rescue then).
        let Some(view) = self.view.since(Some(Instant::now()), shutdown).await? else {
            return Ok(());
        };
        if let Err(e) = rescue::rescue_orphans(&self.dispatcher, &view, shutdown).await {
            tracing::warn!(error = %e, "orphan rescue failed");
        }
        Ok(())
    }
}
