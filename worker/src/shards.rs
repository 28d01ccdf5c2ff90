//! Which shard queues of its group's normal lane this worker consumes (deterministic
//! subsetting, see [`fleet::broker`]).
//!
//! The worker's ordinal is taken by `register.lua` (lowest free in its group) and freed when
//! it deregisters or is evicted — and as soon as it stops consuming (`set_state.lua`: draining,
//! ejected; an ejected worker takes the lowest free ordinal again when it is back), so a
//! draining worker finishing a long task does not keep its shards from its peers. This loop
//! reads the group's ordinal table (one `HGETALL`) at start and every [`REFRESH`] (or heartbeat
//! interval, if shorter), finds its own ordinal, and computes its shards with
//! [`Subsetting::shards_of`]: its `k`-shard subset plus its share of any shard no live
//! ordinal's subset covers (fewer workers than a round, or a gap left by one that went). Every
//! worker reads the same table and computes the same assignment, so every shard keeps a
//! consumer while the group has a registered worker. A change (a peer joined or left, this
//! worker re-registered under another ordinal after Redis lost its data) is sent to the lane,
//! which cancels its consumers and consumes the new set.
//!
//! Until the table has been read — or while this worker is missing from it (between a lost
//! registration and the next heartbeat) — the worker keeps what it consumes; at start-up, with
//! Redis unreadable, that is every shard (over-covering is harmless, under-covering strands
//! tasks).

use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use fleet::broker::Subsetting;
use fleet::process::Ticker;
use fleet::{Lane, Names, Store};

/// How long one read of the ordinal table may take before the loop tries again next tick.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest time between two reads of the ordinal table: how long the shards of a peer that
/// stopped consuming (draining, ejected, gone) may wait for this worker to take them on. One
/// `HGETALL` a second per worker of a sharded group.
pub const REFRESH: Duration = Duration::from_secs(1);

/// Computes this worker's shard queues from the group's ordinal table.
pub struct ShardWatch {
    pub store: Store,
    pub names: Names,
    pub group: String,
    pub worker_id: String,
    pub subsetting: Subsetting,
    pub interval: Duration,
}

impl ShardWatch {
    /// The normal-lane queues to consume now: `None` when the table cannot be read or does not
    /// name this worker.
    ///
    /// # Cancel safety
    /// Cancel safe: one read; dropped, it has changed nothing.
    pub async fn current(&self) -> Option<(u32, Vec<String>)> {
        let table = match tokio::time::timeout(READ_TIMEOUT, self.store.group_ordinals(&self.group))
            .await
        {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                tracing::warn!(error = %e, "cannot read the group's ordinals; keeping the current shards");
                return None;
            }
            Err(_) => return None,
        };
        let own = table
            .iter()
            .find(|(_, id)| **id == self.worker_id)
            .map(|(o, _)| *o)?;
        let live: Vec<u32> = table.keys().copied().collect();
        let shards = self.subsetting.shards_of(own, &live);
        Some((own, self.queues(&shards)))
    }

    /// Queue names of the given shards.
    pub fn queues(&self, shards: &[u32]) -> Vec<String> {
        let n = self.subsetting.shards();
        shards
            .iter()
            .map(|&s| {
                self.names
                    .group_shard_queue(&self.group, Lane::Normal, s, n)
            })
            .collect()
    }

    /// Every shard queue (the fallback before the table is read).
    pub fn all(&self) -> Vec<String> {
        self.names
            .group_shard_queues(&self.group, Lane::Normal, self.subsetting.shards())
    }

    /// Re-reads the table every interval (at most [`REFRESH`]) and sends a changed set, until
    /// `shutdown`.
    pub async fn run(self, tx: watch::Sender<Vec<String>>, shutdown: CancellationToken) {
        let mut ticker = Ticker::new(self.interval.min(REFRESH));
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick(&tx).await,
            }
        }
    }

    /// Reads the table once and sends the set if it changed.
    async fn tick(&self, tx: &watch::Sender<Vec<String>>) {
        let Some((ordinal, queues)) = self.current().await else {
            return;
        };
        tx.send_if_modified(|now| {
            if *now == queues {
                return false;
            }
            tracing::info!(ordinal, shards = ?queues, "shard subset changed");
            *now = queues;
            true
        });
    }
}
