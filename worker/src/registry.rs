//! The worker's registration in Redis: at start-up, again whenever it is found missing, and
//! its removal at the end of a drain.
//!
//! A registration carries a random *instance token* per process. Registering refuses an id
//! held by another instance that heartbeated within `heartbeat_timeout_ms` (two live
//! processes with one id would corrupt each other's load figures), and only the owning instance
//! may heartbeat or deregister. Registration is state that may be lost: when Redis restarts
//! empty or evicts the key, the next heartbeat answers `gone` and the worker registers again
//! with the same token and its current state.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use fleet::registry::{Registration, WorkerState};
use fleet::store::Store;

use crate::config::WorkerConfig;

/// Why start-up registration failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// Another live process holds this worker id.
    #[error("{0} (is another worker running with FLEET_WORKER_ID set to the same id?)")]
    Duplicate(String),
}

/// Registers this worker and keeps it registered.
#[derive(Clone)]
pub struct Registrar {
    store: Store,
    registration: Registration,
    liveness_ms: i64,
}

impl Registrar {
    pub fn new(cfg: &WorkerConfig, store: Store) -> Self {
        Registrar {
            store,
            registration: Registration {
                id: cfg.worker_id.clone(),
                instance: uuid::Uuid::new_v4().simple().to_string(),
                labels: cfg.labels.clone(),
                capacity: cfg.capacity,
                critical_capacity: cfg.critical_capacity,
                executor: cfg.executor.as_str().to_string(),
                state: WorkerState::Active,
            },
            liveness_ms: i64::try_from(cfg.heartbeat_timeout.as_millis()).unwrap_or(i64::MAX),
        }
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
    /// fired first. A live duplicate id is an error: retrying cannot fix it. Cancel safe (a
    /// registration cut short is either done or not; registering again is idempotent).
    pub async fn register_at_startup(&self, shutdown: &CancellationToken) -> Result<bool, RegisterError> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.register(WorkerState::Active).await {
                Ok(()) => return Ok(true),
                Err(fleet::Error::DuplicateWorker(m)) => return Err(RegisterError::Duplicate(m)),
                Err(e) => {
                    metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                    tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "cannot register in Redis");
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(false),
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    /// Registers (again) in the given state.
    pub async fn register(&self, state: WorkerState) -> fleet::Result<()> {
        let mut r = self.registration.clone();
        r.state = state;
        self.store.register(&r, self.liveness_ms).await
    }

    /// Removes the registration (end of drain); errors are logged.
    pub async fn deregister(&self) {
        match self.store.deregister(self.id(), self.instance()).await {
            Ok(true) => tracing::info!("deregistered"),
            Ok(false) => tracing::info!("nothing to deregister (registration gone or held by another instance)"),
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
