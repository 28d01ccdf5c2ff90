//! Heartbeats: a worker's liveness and figures, and the renewal of its running tasks'
//! leases (`heartbeat.lua`). A worker that stops beating is evicted ([`super::evict`]).

use std::time::Duration;

use super::WorkerState;
use crate::error::Result;
use crate::redis::{millis, Store};
use crate::task::{Lane, PerLane};

/// What a heartbeat carries.
#[derive(Debug, Clone, Default)]
pub struct Beat {
    /// Tasks running per lane (copies of a redelivered duplicate count each).
    pub load: PerLane<u32>,
    /// User task attempts that succeeded, since the worker started.
    pub succeeded: u64,
    /// User task attempts whose handler failed, since the worker started.
    pub failed: u64,
    /// Moving average of run times, in milliseconds.
    pub latency_ewma_ms: f64,
    /// The process's CPU utilisation since the previous beat, `0..=1` of all cores.
    pub cpu: f64,
    /// Its weight for weighted routing, `0.05..=1`: `(1 − error ratio) × (1 − cpu / 2)`.
    pub health: f64,
    /// Running tasks: (lane, task id); their leases are renewed.
    pub running: Vec<(Lane, String)>,
    /// The fairness key of each running task that has one (task id → key): the key's
    /// running entry is renewed too (and rebuilt after a Redis loss).
    pub keys: std::collections::HashMap<String, String>,
}

/// The answer to a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeatReply {
    /// Recorded; the worker's state as the registry has it (an operator may have changed it).
    State(WorkerState),
    /// The registration is gone (evicted, or Redis lost its data): register again.
    Gone,
    /// Another process holds this worker id.
    Conflict,
}

impl Store {
    /// A worker's heartbeat: its figures, and its running tasks' leases renewed for `lease`
    /// (Redis time). See `heartbeat.lua`.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn heartbeat(
        &self,
        id: &str,
        instance: &str,
        lease: Duration,
        b: &Beat,
    ) -> Result<BeatReply> {
        let mut inv = self.scripts.heartbeat.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(id)
            .arg(instance)
            .arg(millis(lease))
            .arg(b.load.normal)
            .arg(b.load.critical)
            .arg(b.succeeded)
            .arg(b.failed)
            .arg(format!("{:.3}", b.latency_ewma_ms))
            .arg(format!("{:.3}", b.cpu))
            .arg(format!("{:.3}", b.health));
        for (lane, task) in &b.running {
            match b.keys.get(task) {
                Some(key) => inv.arg(format!("{lane}:{key}|{task}")),
                None => inv.arg(format!("{lane}|{task}")),
            };
        }
        let reply: String = self.invoke(&inv).await?;
        Ok(match reply.as_str() {
            "gone" => BeatReply::Gone,
            "conflict" => BeatReply::Conflict,
            s => BeatReply::State(WorkerState::parse(s).unwrap_or(WorkerState::Active)),
        })
    }
}
