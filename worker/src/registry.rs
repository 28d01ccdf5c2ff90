//! The worker's registration in Redis: at start-up, again whenever it is found missing, and
//! its removal at the end of a drain.
//!
//! A registration carries a random *instance token* per process. Registering refuses an id
//! held by another instance that heartbeated within `heartbeat_timeout_ms` (two live
//! processes with one id would corrupt each other's load figures), and only the owning instance
//! may heartbeat or deregister.
//!
//! A recent heartbeat does not prove the holder alive, though: a worker killed with SIGKILL
//! and restarted at once with the same id (systemd, a Kubernetes StatefulSet) finds its own
//! dead predecessor's registration. So at start-up a refused registration is not final at
//! once: the worker watches the holder. If the holder heartbeats again it is alive and start-up
//! fails with a message; if it stays silent past the window, its registration counts as stale
//! and this worker registers in its place (at most `heartbeat_timeout_ms` after the holder's
//! last beat). Registration is state that may be lost: when Redis restarts
//! empty or evicts the key, the next heartbeat answers `gone` and the worker registers again
//! with the same token and its current state.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use fleet::redis::Store;
use fleet::registry::{Registration, WorkerState};

use crate::config::WorkerConfig;

/// Why start-up registration failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// Another live process holds this worker id.
    #[error("{0}; is another worker running with FLEET_WORKER_ID set to the same id?")]
    Duplicate(String),
    /// Redis refused us in a way no retry can fix (password).
    #[error(transparent)]
    Permanent(fleet::Error),
}

/// How often the holder of our id is looked at while start-up waits to see whether it is alive.
const DUPLICATE_POLL: Duration = Duration::from_millis(100);
/// How soon registration is tried again while the worker's group is being reclaimed.
const RECLAIM_POLL: Duration = Duration::from_millis(250);

/// Registers this worker and keeps it registered.
#[derive(Clone)]
pub struct Registrar {
    store: Store,
    registration: Registration,
    liveness: std::time::Duration,
    /// For error messages (password hidden when printed).
    redis_url: String,
    /// This process holds the id's broker lock: a previous holder is gone, take over at once.
    takeover: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Declares the group's queues (again when a reclaim deleted them) and says when.
    broker: Option<std::sync::Arc<crate::broker::Broker>>,
}

impl Registrar {
    /// `kinds`: the task kinds the worker handles, as its handlers advertise them
    /// ([`crate::executor::Handlers::kinds`]).
    pub fn new(cfg: &WorkerConfig, store: Store, kinds: fleet::registry::Kinds) -> Self {
        Registrar {
            store,
            redis_url: cfg.common.redis_url.clone(),
            registration: Registration {
                id: cfg.worker_id.clone(),
                instance: uuid::Uuid::new_v4().simple().to_string(),
                labels: cfg.labels.clone(),
                capacity: cfg.capacity.normal,
                critical_capacity: cfg.capacity.critical,
                executor: cfg.executor.as_str().to_string(),
                state: WorkerState::Active,
                kinds,
            },
            liveness: cfg.heartbeat_timeout,
            takeover: Default::default(),
            broker: None,
        }
    }

    /// The broker link that declares this worker's group queues: registrations then say when
    /// they were declared, and a group reclaimed since has them declared again (see
    /// `fleet::registry::Store::register_declared`).
    pub fn with_broker(mut self, broker: std::sync::Arc<crate::broker::Broker>) -> Self {
        self.broker = Some(broker);
        self
    }

    /// Says whether this process holds the id's broker lock (see [`crate::broker::Broker::lock_id`]).
    pub fn set_takeover(&self, held: bool) {
        self.takeover
            .store(held, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn id(&self) -> &str {
        &self.registration.id
    }

    pub fn instance(&self) -> &str {
        &self.registration.instance
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Registers as `active`, retrying while Redis is unreachable. `Ok(false)` when `shutdown`
    /// fired first. An id held by another instance is watched (see the module docs): an error
    /// once the holder proves alive by heartbeating, retrying cannot fix that.
    ///
    /// # Cancel safety
    /// Cancel safe: a registration cut short is either done or not (one script call), and
    /// registering again is idempotent.
    pub async fn register_at_startup(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<bool, RegisterError> {
        let mut delay = Duration::from_millis(100);
        // The holder of our id as first seen: (instance, last heartbeat).
        let mut holder: Option<(String, i64)> = None;
        loop {
            let mut pause = delay;
            match self.register(WorkerState::Active).await {
                Ok(()) => return Ok(true),
                Err(fleet::Error::DuplicateWorker(m)) => {
                    match self.store.worker_holder(self.id()).await {
                        Ok(Some(now)) => match &holder {
                            None => {
                                tracing::warn!(holder = %now.0, "{m}: waiting to see whether it is alive (a crashed predecessor stays silent)");
                                holder = Some(now);
                            }
                            Some(first) if *first != now => {
                                return Err(RegisterError::Duplicate(m))
                            }
                            Some(_) => {}
                        },
                        // Gone meanwhile (deregistered or evicted): register at once.
                        Ok(None) => continue,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot read the holder of this worker id")
                        }
                    }
                    pause = DUPLICATE_POLL;
                }
                // Its queues are being deleted (they were declared again): soon.
                Err(fleet::Error::Reclaiming(_)) => pause = RECLAIM_POLL,
                Err(e) => {
                    if let Some(p) = fleet::redis::permanent(&e, &self.redis_url) {
                        return Err(RegisterError::Permanent(p));
                    }
                    metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                    tracing::warn!(setting = "FLEET_REDIS_URL", error = %e, retry_in_ms = delay.as_millis() as u64, "cannot register in Redis; retrying");
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(false),
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Registers (again) in the given state.
    pub async fn register(&self, state: WorkerState) -> fleet::Result<()> {
        let mut r = self.registration.clone();
        r.state = state;
        let takeover = self.takeover.load(std::sync::atomic::Ordering::Relaxed);
        let Some(broker) = &self.broker else {
            return self.store.register_with(&r, self.liveness, takeover).await;
        };
        // The declaration's time on Redis's clock (the fleet's one clock).
        let declared = match broker.declared_at_ms() {
            0 => 0,
            t => t + (self.store.clock.now_ms() - fleet::redis::now_ms()),
        };
        let result = self
            .store
            .register_declared(&r, self.liveness, takeover, declared)
            .await;
        if let Err(fleet::Error::Reclaiming(why)) = &result {
            // The group was reclaimed (or is being): its queues may be gone. Declare them
            // again, so the next attempt registers with queues that exist.
            tracing::info!(reason = %why, "group reclaimed meanwhile: declaring its queues again before registering");
            if let Err(e) = broker.redeclare().await {
                tracing::warn!(error = %e, "cannot declare the group's queues again; retrying");
            }
        }
        result
    }

    /// Removes the registration (end of drain); errors are logged.
    pub async fn deregister(&self) {
        match self.store.deregister(self.id(), self.instance()).await {
            Ok(true) => tracing::info!("deregistered"),
            Ok(false) => tracing::info!(
                "nothing to deregister (registration gone or held by another instance)"
            ),
            Err(e) => {
                metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                tracing::warn!(error = %e, "cannot deregister; the health checker will evict this worker");
            }
        }
    }
}

/// Sets a worker's state, logging failures; returns the previous state when known.
pub async fn set_state_logged(store: &Store, id: &str, state: WorkerState) -> Option<WorkerState> {
    match store.set_state(id, state).await {
        Ok(prev) => prev,
        Err(e) => {
            metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
            tracing::warn!(error = %e, state = state.as_str(), "cannot set worker state in Redis; the next heartbeat retries");
            None
        }
    }
}
