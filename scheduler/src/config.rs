//! Scheduler settings (see `fleet::config` for how they are read).

use std::time::Duration;

use fleet::config::{CommonConfig, Settings};
use fleet::route::Strategy;
use fleet::Result;

/// Everything the scheduler reads at start-up.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub common: CommonConfig,
    pub strategy: Strategy,
    /// Extra dispatch beyond capacity, as a fraction: a group has room while
    /// `running + reserved < capacity × (1 + backlog_factor)`. A little backlog keeps workers
    /// fed between dispatch batches; too much recreates the hoarding prefetch prevents.
    pub backlog_factor: f64,
    pub reservation_lease: Duration,
    pub max_pending: u32,
    pub pending_yellow: f64,
    pub pending_red: f64,
    pub load_yellow: f64,
    pub load_red: f64,
    pub throttle: Duration,
    pub red_recheck: Duration,
    pub pressure_interval: Duration,
    pub rate: f64,
    pub burst: u32,
    pub critical_rate: f64,
    pub critical_burst: u32,
    /// Optional limit on HTTP submissions per second (0 = none); over it the API answers 429.
    pub submit_rate: f64,
    pub dedupe_window: Duration,
    pub health_interval: Duration,
    pub heartbeat_timeout: Duration,
    pub no_match_grace: Duration,
    pub probe_interval: Duration,
    pub probe_timeout: Duration,
    pub stats_interval: Duration,
    /// How often the console's throughput and wait-time history takes a point.
    pub series_interval: Duration,
    pub batch_max: u16,
    /// Concurrent dispatch loops on the normal ingress queue: while one batch waits for its
    /// publisher confirms the next is already being routed.
    pub ingress_consumers: u16,
    /// API bearer tokens and their roles (`FLEET_API_TOKENS`; none: the API is open).
    pub auth: crate::api::guard::ApiAuth,
}

impl SchedulerConfig {
    pub fn from_settings(s: &Settings) -> Result<Self> {
        let common = CommonConfig::from_settings(s, "127.0.0.1:8080")?;
        let strategy = s.choice("strategy", "least_loaded", &["least_loaded", "round_robin", "weighted"])?;
        let pending_yellow = s.ratio("pending_yellow", 0.7)?;
        let pending_red = s.ratio("pending_red", 0.9)?;
        let load_yellow = s.ratio("load_yellow", 0.68)?;
        let load_red = s.ratio("load_red", 0.85)?;
        if pending_yellow > pending_red {
            return Err(s.error("pending_yellow", "must not be above FLEET_PENDING_RED"));
        }
        if load_yellow > load_red {
            return Err(s.error("load_yellow", "must not be above FLEET_LOAD_RED"));
        }
        let backlog_factor: f64 = s.parse("backlog_factor", 1.0)?;
        if !(0.0..=100.0).contains(&backlog_factor) {
            return Err(s.error("backlog_factor", "must be between 0 and 100"));
        }
        let submit_rate: f64 = s.parse("submit_rate", 0.0)?;
        if submit_rate < 0.0 {
            return Err(s.error("submit_rate", "must not be negative"));
        }
        Ok(SchedulerConfig {
            strategy: Strategy::parse(&strategy).unwrap_or_default(),
            backlog_factor,
            reservation_lease: s.millis("reservation_lease_ms", 30_000)?,
            max_pending: s.positive("max_pending", 1000u32)?,
            pending_yellow,
            pending_red,
            load_yellow,
            load_red,
            throttle: s.millis("throttle_ms", 500)?,
            red_recheck: s.millis("red_recheck_ms", 2000)?,
            pressure_interval: s.millis("pressure_interval_ms", 250)?,
            rate: s.positive("rate", 3000.0)?,
            burst: s.positive("burst", 6000u32)?,
            critical_rate: s.positive("critical_rate", 1000.0)?,
            critical_burst: s.positive("critical_burst", 2000u32)?,
            submit_rate,
            dedupe_window: s.millis("dedupe_window_ms", 3_600_000)?,
            health_interval: s.millis("health_interval_ms", 10_000)?,
            heartbeat_timeout: s.millis("heartbeat_timeout_ms", 30_000)?,
            no_match_grace: s.millis("no_match_grace_ms", 60_000)?,
            probe_interval: s.millis("probe_interval_ms", 10_000)?,
            probe_timeout: s.millis("probe_timeout_ms", 5_000)?,
            stats_interval: s.millis("stats_interval_ms", 1000)?,
            series_interval: s.millis("series_interval_ms", 2000)?,
            batch_max: s.positive("batch_max", 256u16)?,
            ingress_consumers: s.positive("ingress_consumers", 4u16)?,
            auth: crate::api::guard::ApiAuth::from_settings(s)?,
            common,
        })
    }

    pub fn rate_for(&self, lane: fleet::Lane) -> (f64, u32) {
        match lane {
            fleet::Lane::Normal => (self.rate, self.burst),
            fleet::Lane::Critical => (self.critical_rate, self.critical_burst),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_the_setting() {
        for (k, v, name) in [
            ("rate", "0", "FLEET_RATE"),
            ("rate", "-5", "FLEET_RATE"),
            ("burst", "x", "FLEET_BURST"),
            ("strategy", "fastest", "FLEET_STRATEGY"),
            ("pending_red", "2", "FLEET_PENDING_RED"),
            ("load_yellow", "0.9", "FLEET_LOAD_YELLOW"),
        ] {
            let s = Settings::from_pairs([(k, v.to_string())]);
            let e = SchedulerConfig::from_settings(&s).unwrap_err().to_string();
            assert!(e.contains(name), "{k}={v}: {e}");
        }
        let ok = SchedulerConfig::from_settings(&Settings::default()).unwrap();
        assert_eq!(ok.max_pending, 1000);
        assert_eq!(ok.rate, 3000.0);
        assert_eq!(ok.burst, 6000);
    }
}
