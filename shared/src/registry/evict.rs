//! Taking workers out of service: eviction of the silent (`evict.lua`, run by the scheduler's
//! health checker; idempotent, so any number of replicas may run it) and outlier ejection
//! (`eject.lua`, never the last active capacity of a group).

use std::time::Duration;

use crate::error::Result;
use crate::redis::{millis, Store};

impl Store {
    /// Ejects an active worker unless it is the last active capacity of its group.
    /// `Some(true)` ejected, `Some(false)` refused (last one), `None` unknown or not active.
    pub async fn try_eject(&self, id: &str) -> Result<Option<bool>> {
        let mut inv = self.scripts.eject.prepare_invoke();
        inv.key(self.names.prefix()).arg(id);
        let r: i64 = self.invoke(&inv).await?;
        Ok(match r {
            1 => Some(true),
            0 => Some(false),
            _ => None,
        })
    }

    /// Evicts workers silent for longer than `timeout` (Redis time); returns their ids.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn evict_stale(&self, timeout: Duration) -> Result<Vec<String>> {
        let mut inv = self.scripts.evict.prepare_invoke();
        inv.key(self.names.prefix()).arg(millis(timeout));
        self.invoke(&inv).await
    }
}
