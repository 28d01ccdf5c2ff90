//! Scheduler settings (see `fleet::settings` for how they are read).

use std::time::Duration;

use fleet::settings::SchedulerArgs;
use fleet::settings::{CommonConfig, Settings};
use fleet::task::Strategy;
use fleet::{Error, PerLane, Result};

/// How often park discovery looks at the groups of the fleet view
/// ([`crate::park::Discovery`]): fixed, not a setting. The fleet view takes it into its tick
/// ([`crate::view::interval`]) and into how long it takes a missing park queue as missing.
pub const PARK_DISCOVERY_INTERVAL: Duration = Duration::from_secs(2);

/// Everything the scheduler reads at start-up.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub common: CommonConfig,
    pub strategy: Strategy,
    /// Extra dispatch beyond capacity, as a fraction: a group has room while
    /// `running + reserved < capacity × (1 + backlog_factor)`. A little backlog keeps workers
    /// fed between dispatch batches; too much recreates the hoarding prefetch prevents.
    pub backlog_factor: f64,
    /// How long a task may queue in front of a group's workers: a group's room is its
    /// completion rate × this (Little's law), at least `capacity × (1 + backlog_factor)`.
    pub target_queue: Duration,
    pub reservation_lease: Duration,
    pub max_pending: u32,
    pub pending_yellow: f64,
    pub pending_red: f64,
    pub load_yellow: f64,
    pub load_red: f64,
    pub throttle: Duration,
    pub red_recheck: Duration,
    pub pressure_interval: Duration,
    /// Minimum dwell of a pressure state before it gives way to a lower one
    /// ([`crate::backpressure`]).
    pub pressure_hold: Duration,
    /// Each lane's cluster-wide dispatch rate limit per second (0 = off, the default: it
    /// protects a downstream quota only the operator knows; 3,000/s burst 6,000 is the
    /// documented example for the normal lane): `FLEET_RATE`, `FLEET_CRITICAL_RATE`.
    pub rate: PerLane<f64>,
    /// Each lane's burst (tokens): `FLEET_BURST`, `FLEET_CRITICAL_BURST`.
    pub burst: PerLane<u32>,
    /// Optional limit on HTTP submissions per second (0 = none); over it the API answers 429.
    pub submit_rate: f64,
    pub dedupe_window: Duration,
    pub health_interval: Duration,
    pub heartbeat_timeout: Duration,
    pub no_match_grace: Duration,
    /// How long a group has had no worker and no task before it is reclaimed (`None`: never).
    pub group_reclaim_after: Option<Duration>,
    pub probe_interval: Duration,
    pub probe_timeout: Duration,
    pub stats_interval: Duration,
    /// How often the console's throughput and wait-time history takes a point.
    pub series_interval: Duration,
    pub batch_max: u16,
    /// Concurrent dispatch loops on the normal ingress queue: while one batch waits for its
    /// publisher confirms the next is already being routed.
    pub ingress_consumers: u16,
    /// Fairness keys' limits from the settings (`FLEET_KEY_DEFAULT`, `FLEET_KEY_LIMITS`): the
    /// base the control stream's `key_limit` records override ([`fleet::control::KeyOverrides`]).
    pub key_limits: fleet::control::KeyLimits,
    /// Keys shown one by one in the `fleet_key_*` metrics (`FLEET_KEY_METRICS_TOP`).
    pub key_metrics_top: usize,
    /// A key idle this long (not routed, nothing waiting, no live lease) is forgotten
    /// (`FLEET_KEY_FORGET_MS`; [`fleet::Store::forget_idle_keys`]).
    pub key_forget: Duration,
    /// How often the schedule firing loop looks for due ticks.
    pub schedule_poll: Duration,
    /// How late a schedule's tick may still be submitted; later it is missed (and handled by
    /// the schedule's missed-fire policy). Refused fires are retried within it.
    pub schedule_tolerance: Duration,
}

impl SchedulerConfig {
    /// What every reservation batch of this scheduler passes to `reserve.lua`, with a fresh
    /// batch token (direct dispatch on).
    pub fn reserve_params(&self) -> fleet::route::ReserveParams {
        fleet::route::ReserveParams {
            token: rand::random(),
            lease_ms: self.reservation_lease.as_millis() as i64,
            backlog_factor: self.backlog_factor,
            strategy: self.strategy,
            dedupe_window_ms: self.dedupe_window.as_millis() as i64,
            status_ttl_ms: self.common.status_ttl.as_millis() as i64,
            direct: true,
            park_flag_ttl_ms: fleet::route::park::FLAG_TTL_MS,
        }
    }

    /// The reclaim loop's tick ([`crate::reclaim`]): `min(FLEET_GROUP_RECLAIM_AFTER_MS,
    /// FLEET_HEALTH_INTERVAL_MS)`, at least 100 ms (the health interval alone when reclaim is
    /// off).
    pub fn reclaim_interval(&self) -> Duration {
        self.group_reclaim_after
            .map_or(self.health_interval, |g| g.min(self.health_interval))
            .max(Duration::from_millis(100))
    }

    /// Reads every scheduler setting from `s` (see [`fleet::settings::SchedulerArgs`]).
    pub fn from_settings(s: &Settings) -> Result<Self> {
        Self::from_args(fleet::settings::parse::<SchedulerArgs>(s)?)
    }

    /// Validates what the declarations cannot check alone (relations between settings).
    pub fn from_args(a: SchedulerArgs) -> Result<Self> {
        let common = CommonConfig::from_args(&a.common, a.http_addr.trim().to_string())?;
        if a.pending_yellow > a.pending_red {
            return Err(Error::config(
                "FLEET_PENDING_YELLOW",
                "must not be above FLEET_PENDING_RED",
            ));
        }
        if a.load_yellow > a.load_red {
            return Err(Error::config(
                "FLEET_LOAD_YELLOW",
                "must not be above FLEET_LOAD_RED",
            ));
        }
        // The dedupe mark is a field of the task's status record (`fleet::route::dedupe`):
        // the record must live at least the window for the mark to.
        if a.common.status_ttl_ms < a.dedupe_window_ms {
            return Err(Error::config(
                "FLEET_STATUS_TTL_MS",
                "must not be below FLEET_DEDUPE_WINDOW_MS (a task id's dedupe mark lives in its status record)",
            ));
        }
        let key_limits = fleet::control::KeyLimits::from_settings(&a.key_default, &a.key_limits)
            .map_err(|(name, e)| Error::config(name, e))?;
        let ms = Duration::from_millis;
        Ok(SchedulerConfig {
            key_limits,
            key_metrics_top: a.key_metrics_top,
            key_forget: ms(a.key_forget_ms),
            strategy: Strategy::parse(&a.strategy).unwrap_or_default(),
            backlog_factor: a.backlog_factor,
            target_queue: ms(a.target_queue_ms),
            reservation_lease: ms(a.reservation_lease_ms),
            max_pending: a.max_pending,
            pending_yellow: a.pending_yellow,
            pending_red: a.pending_red,
            load_yellow: a.load_yellow,
            load_red: a.load_red,
            throttle: ms(a.throttle_ms),
            red_recheck: ms(a.red_recheck_ms),
            pressure_interval: ms(a.pressure_interval_ms),
            pressure_hold: ms(a.pressure_hold_ms),
            rate: PerLane {
                normal: a.rate,
                critical: a.critical_rate,
            },
            burst: PerLane {
                normal: a.burst,
                critical: a.critical_burst,
            },
            submit_rate: a.submit_rate,
            dedupe_window: ms(a.dedupe_window_ms),
            health_interval: ms(a.health_interval_ms),
            heartbeat_timeout: ms(a.heartbeat_timeout_ms),
            no_match_grace: ms(a.no_match_grace_ms),
            group_reclaim_after: (a.group_reclaim_after_ms > 0)
                .then(|| ms(a.group_reclaim_after_ms)),
            probe_interval: ms(a.probe_interval_ms),
            probe_timeout: ms(a.probe_timeout_ms),
            stats_interval: ms(a.stats_interval_ms),
            batch_max: a.batch_max,
            ingress_consumers: a.ingress_consumers,
            schedule_poll: ms(a.schedule_poll_ms),
            schedule_tolerance: ms(a.schedule_tolerance_ms),
            series_interval: ms(a.series_interval_ms),
            common,
        })
    }

    /// The rate limit of a lane, `None` when off.
    pub fn rate_for(&self, lane: fleet::Lane) -> Option<(f64, u32)> {
        (self.rate[lane] > 0.0).then_some((self.rate[lane], self.burst[lane]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_values_name_the_setting() {
        for (k, v, name) in [
            ("rate", "-5", "FLEET_RATE"),
            ("rate", "fast", "FLEET_RATE"),
            ("burst", "x", "FLEET_BURST"),
            ("strategy", "fastest", "FLEET_STRATEGY"),
            ("pending_red", "2", "FLEET_PENDING_RED"),
            ("load_yellow", "0.9", "FLEET_LOAD_YELLOW"),
            ("key_default", "rate=fast", "FLEET_KEY_DEFAULT"),
            ("key_limits", "acme:weight=0", "FLEET_KEY_LIMITS"),
            ("key_metrics_top", "0", "FLEET_KEY_METRICS_TOP"),
            ("key_forget_ms", "0", "FLEET_KEY_FORGET_MS"),
        ] {
            let s = Settings::from_pairs([(k, v.to_string())]);
            let e = SchedulerConfig::from_settings(&s).unwrap_err().to_string();
            assert!(e.contains(name), "{k}={v}: {e}");
        }
        let ok = SchedulerConfig::from_settings(&Settings::default()).unwrap();
        assert_eq!(ok.max_pending, 1000);
        assert_eq!(ok.rate.normal, 0.0, "the rate limit is opt-in");
        assert_eq!(ok.rate_for(fleet::Lane::Normal), None);
        assert_eq!(ok.burst.normal, 6000);
        let on =
            SchedulerConfig::from_settings(&Settings::from_pairs([("rate", "3000".to_string())]))
                .unwrap();
        assert_eq!(on.rate_for(fleet::Lane::Normal), Some((3000.0, 6000)));
    }
}
