//! Short timings the lifecycle tests share (heartbeats, the health tick), so eviction,
//! orphan rescue and drains happen within a test's timeouts.

/// Worker heartbeat period in these tests.
pub const HEARTBEAT_MS: u64 = 300;
/// Silence after which a worker is evicted (scheduler) / an id counts as live (worker).
pub const HEARTBEAT_TIMEOUT_MS: u64 = 1500;
/// The scheduler's health tick (eviction + orphan rescue).
pub const HEALTH_MS: u64 = 300;

/// Scheduler settings of these tests: fast health checks, no probe traffic after the first
/// tick (probe tasks would otherwise show up at the recording endpoint and in eject windows).
pub const SCHEDULER: &[(&str, &str)] = &[
    ("health_interval_ms", "300"),
    ("heartbeat_timeout_ms", "1500"),
    ("probe_interval_ms", "600000"),
];

/// In-process worker settings matching [`SCHEDULER`].
pub const WORKER: &[(&str, &str)] = &[
    ("heartbeat_interval_ms", "300"),
    ("heartbeat_timeout_ms", "1500"),
];

/// Worker setting that turns outlier ejection off. Tests that fail many tasks on purpose
/// use it: with every attempt failing, a worker would otherwise take itself out of rotation
/// (see `worker/src/eject.rs`) and the retries would find no worker.
pub const NO_EJECT: (&str, &str) = ("eject_error_ratio", "1");
