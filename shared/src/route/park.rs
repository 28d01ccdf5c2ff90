//! Parking: a task whose candidate groups are all full waits in a park queue of the group that
//! will free room first (`<ns>.park.<group>.<lane>`), not in the group's own queue, so it can
//! still go to whichever group frees a slot first. The scheduler's release loops
//! (`scheduler/src/park/`) offer parked tasks again as room frees up.
//!
//! While a group has parked tasks its flag (`pk:<group>:<lane>`, [`crate::Names::parked`]) is
//! set — by `route/reserve.lua` when a task parks, renewed by the release loop while it holds
//! tasks — and the group counts as full for new work, so new tasks queue behind parked ones
//! instead of overtaking them. The flag expires by itself ([`FLAG_TTL_MS`]) if its scheduler dies.

use deadpool_redis::redis;

use crate::error::Result;
use crate::redis::Store;
use crate::task::Lane;

/// Lifetime of a group's "has parked tasks" flag (ms) unless renewed.
pub const FLAG_TTL_MS: i64 = 3000;

impl Store {
    /// Keeps a group's "has parked tasks" flag alive (the park loop calls this while it holds
    /// tasks), so new work keeps queueing behind parked work.
    pub async fn mark_parked(&self, group: &str, lane: Lane, ttl_ms: i64) -> Result<()> {
        self.query::<()>(
            redis::cmd("SET")
                .arg(self.names.parked(group, lane))
                .arg(1)
                .arg("PX")
                .arg(ttl_ms),
        )
        .await
    }

    /// How many fair park queues of `group`'s `lane` `reserve.lua` has assigned to waiting
    /// keys so far (keys assigned, counted; the caller bounds it by `FLEET_FAIR_QUEUES`).
    pub async fn fair_queues_assigned(&self, group: &str, lane: Lane) -> Result<u16> {
        let n: Option<u64> = self
            .query(
                redis::cmd("HGET")
                    .arg(self.names.fair_assignments(group, lane))
                    .arg("#"),
            )
            .await?;
        Ok(u16::try_from(n.unwrap_or(0)).unwrap_or(u16::MAX))
    }

    /// Clears a group's "has parked tasks" flag (its park loop released everything).
    pub async fn clear_parked(&self, group: &str, lane: Lane) -> Result<()> {
        self.query::<()>(redis::cmd("DEL").arg(self.names.parked(group, lane)))
            .await
    }
}
