//! Metric names (the public interface dashboards depend on), their help text and the
//! Prometheus exporter. Label values are bounded: lane, group, outcome, reason, queue, state —
//! never task ids.

use std::sync::OnceLock;

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Counter: tasks accepted from ingress, by lane.
pub const TASKS_SUBMITTED: &str = "fleet_tasks_submitted_total";
/// Counter: tasks refused as invalid or undeliverable and dead-lettered, by reason.
pub const TASKS_REJECTED: &str = "fleet_tasks_rejected_total";
/// Counter: tasks published to a group queue, by group and lane.
pub const TASKS_DISPATCHED: &str = "fleet_tasks_dispatched_total";
/// Counter: user task attempts ended, by group, lane and outcome (succeeded, failed, retried, dead,
/// expired); health probes are counted in fleet_probes_completed_total.
pub const TASKS_COMPLETED: &str = "fleet_tasks_completed_total";
/// Counter: submissions dropped because their id was seen within the dedupe window.
pub const TASKS_DUPLICATE: &str = "fleet_tasks_duplicate_total";
/// Cancels accepted by the API (`POST /v1/tasks/{id}/cancel`, answered 202).
pub const TASKS_CANCELLED: &str = "fleet_tasks_cancelled_total";
/// Counter: tasks parked in a group's wait queue because no matching group had room, by group.
pub const TASKS_PARKED: &str = "fleet_tasks_parked_total";
/// Counter: tasks moved from a group without live workers to another matching group.
pub const TASKS_REROUTED: &str = "fleet_tasks_rerouted_total";
/// Counter: submissions refused to producers (HTTP 429/503), by reason.
pub const TASKS_REFUSED: &str = "fleet_tasks_refused_total";
/// Counter: HTTP submissions published again because their publisher confirm was lost with the
/// connection (node loss); copies are dropped by the dedupe window.
pub const TASKS_REPUBLISHED: &str = "fleet_tasks_republished_total";
/// Counter: publishing channels opened afresh because every publish on the one before was nacked
/// for 2 s with its queue far below any bound (a channel stuck after a quorum leader's
/// election), by user (`api`, `dispatch`).
pub const PUBLISHER_RENEWALS: &str = "fleet_publisher_renewals_total";
/// Counter: Redis calls answered READONLY (a demoted master); each empties the connection pool so
/// the next call reconnects (through Sentinel, to the new master).
pub const REDIS_READ_ONLY: &str = "fleet_redis_read_only_total";
/// Counter: Sentinel `+switch-master` announcements for fleet's master heard by this process; each
/// drops its Redis connections so the next call goes to the new master.
pub const REDIS_MASTER_SWITCHES: &str = "fleet_redis_master_switches_total";
/// Histogram (seconds): time from submission to start, by lane.
pub const TASK_WAIT: &str = "fleet_task_wait_seconds";
/// Histogram (seconds): handler run time, by group and lane.
pub const TASK_RUN: &str = "fleet_task_run_seconds";
/// Gauge: messages ready in a queue, sampled by the scheduler.
pub const QUEUE_DEPTH: &str = "fleet_queue_depth";
/// Gauge: configured maximum length of a bounded queue.
pub const QUEUE_BOUND: &str = "fleet_queue_bound";
/// Gauge: backpressure state: 0 green, 1 yellow, 2 red.
pub const PRESSURE_STATE: &str = "fleet_pressure_state";
/// Gauge: pending tasks: ingress backlog + parked + reserved-not-started.
pub const PENDING: &str = "fleet_pending_tasks";
/// Gauge: normal-lane capacity of a group's active, alive workers.
pub const GROUP_CAPACITY: &str = "fleet_group_capacity";
/// Gauge: normal-lane tasks running in a group.
pub const GROUP_LOAD: &str = "fleet_group_load";
/// Gauge: normal-lane tasks dispatched to a group and not yet started.
pub const GROUP_RESERVED: &str = "fleet_group_reserved";
/// Gauge: tasks waiting for a group and ready to run: its queue plus the park queue of each
/// lane not paused (autoscaling input; a paused lane's parked tasks are in
/// [`GROUP_BACKLOG_PAUSED`]).
pub const GROUP_BACKLOG: &str = "fleet_group_backlog";
/// Gauge: tasks waiting for a group in the park queue of a paused lane (an operator's pause:
/// no worker would run them, so no autoscaler should scale up for them).
pub const GROUP_BACKLOG_PAUSED: &str = "fleet_group_backlog_paused";
/// Gauge: whether a group has a paused lane (1) or not (0).
pub const GROUP_PAUSED: &str = "fleet_group_paused";
/// Gauge: age of the oldest task waiting for a group, in seconds (autoscaling input).
pub const GROUP_OLDEST_AGE: &str = "fleet_group_oldest_task_age_seconds";
/// Gauge: tasks waiting for a group lane that could run now if there were room (autoscaling
/// input: `GET /v1/scaling`, see the scheduler's `scaling` module).
pub const SCALING_READY: &str = "fleet_scaling_ready";
/// Gauge: tasks waiting for a group lane that more workers would not run, by `cause`
/// (`paused`, `over_key_limit`, `not_yet_due`, `rate_limited`).
pub const SCALING_BLOCKED: &str = "fleet_scaling_blocked";
/// Gauge: age of a group lane's oldest ready task, in seconds (0 when none is ready).
pub const SCALING_OLDEST_READY_AGE: &str = "fleet_scaling_oldest_ready_age_seconds";
/// Gauge: tasks of a fairness key running now, by key: the `FLEET_KEY_METRICS_TOP` keys with
/// the most tasks waiting, the rest summed under `key="other"` (bounded label values).
pub const KEY_RUNNING: &str = "fleet_key_running";
/// Gauge: tasks of a fairness key parked waiting for room now, by key (top N and `other`).
pub const KEY_WAITING: &str = "fleet_key_waiting";
/// Gauge: a fairness key's `max_running` in force, by key (top N keys that have one).
pub const KEY_MAX_RUNNING: &str = "fleet_key_max_running";
/// Gauge: groups (label sets) the fleet knows: registered and not reclaimed.
pub const GROUPS: &str = "fleet_groups";
/// Counter: departed groups reclaimed (no worker and empty queues for
/// FLEET_GROUP_RECLAIM_AFTER_MS): keys, queues and consumers removed.
pub const GROUPS_RECLAIMED: &str = "fleet_groups_reclaimed_total";
/// Gauge: registered workers by state.
pub const WORKERS: &str = "fleet_workers";
/// Counter: workers evicted by the health checker for missing heartbeats.
pub const WORKER_EVICTIONS: &str = "fleet_worker_evictions_total";
/// Counter: times a worker ejected itself as an outlier (error ratio over the threshold).
pub const WORKER_EJECTIONS: &str = "fleet_worker_ejections_total";
/// Gauge: always 1; labels name the worker and its group.
pub const WORKER_INFO: &str = "fleet_worker_info";
/// Counter: dispatches delayed by the rate limit or by Yellow pressure.
pub const DISPATCH_THROTTLED: &str = "fleet_dispatch_throttled_total";
/// Counter: fairness-key slots (reserved or running) whose lease lapsed without their task
/// giving them back — leaked by a crash or a lost Redis write — dropped by the reservation.
pub const KEY_SLOTS_RECLAIMED: &str = "fleet_key_slots_reclaimed_total";
/// Gauge (seconds): age of the newest delay canary back from the delay tiers (scheduler; see
/// `fleet_scheduler::canary`): ~5 s while delayed work moves, growing while the path is stuck.
pub const DELAY_CANARY_AGE: &str = "fleet_delay_canary_age_seconds";
/// Histogram (seconds): round trip of the scheduler's probe task through a group's critical lane.
pub const PROBE: &str = "fleet_probe_seconds";
/// Counter: probe tasks that did not come back in time, by group.
pub const PROBE_FAILURES: &str = "fleet_probe_failures_total";
/// Counter: health probes a worker ran, by group and outcome (kept out of
/// fleet_tasks_completed_total).
pub const PROBES_COMPLETED: &str = "fleet_probes_completed_total";
/// Counter: failed Redis calls (retried).
pub const REDIS_ERRORS: &str = "fleet_redis_errors_total";
/// Counter: reconnections to RabbitMQ.
pub const AMQP_RECONNECTS: &str = "fleet_amqp_reconnects_total";
/// Gauge (seconds): this process's clock minus the Redis server's (fleet's one clock), as last
/// measured.
pub const CLOCK_SKEW: &str = "fleet_clock_skew_seconds";
/// Counter: deliveries of an attempt that already ran or runs elsewhere (scheduler crash, consumer
/// timeout, lost ack), acked without running, by lane.
pub const DUPLICATE_DELIVERIES: &str = "fleet_tasks_duplicate_deliveries_total";
/// Counter: tasks submitted by periodic schedules, by schedule and trigger (cron, manual).
pub const SCHEDULE_FIRES: &str = "fleet_schedule_fires_total";
/// Counter: schedule ticks not fired, by schedule and reason (skipped, catch_up_limit,
/// pressure_red, ingress_full, error).
pub const SCHEDULE_MISSES: &str = "fleet_schedule_misses_total";
/// Histogram (seconds): time from a schedule's tick to its confirmed submission, by schedule.
pub const SCHEDULE_LAG: &str = "fleet_schedule_lag_seconds";

/// Registers help text for every metric.
pub fn describe() {
    describe_counter!(TASKS_SUBMITTED, "Tasks accepted from ingress, by lane.");
    describe_counter!(
        TASKS_REJECTED,
        "Tasks refused as invalid or undeliverable and dead-lettered, by reason."
    );
    describe_counter!(
        TASKS_DISPATCHED,
        "Tasks published to a group queue, by group and lane."
    );
    describe_counter!(
        TASKS_CANCELLED,
        "Cancels accepted by the API (POST /v1/tasks/{id}/cancel answered 202)."
    );
    describe_counter!(TASKS_COMPLETED, "User task attempts ended, by group, lane and outcome (succeeded, failed, retried, dead, expired, cancelled: stopped by an operator while running, or — group `none` — dropped by the scheduler before dispatch); health probes are counted in fleet_probes_completed_total.");
    describe_counter!(
        TASKS_DUPLICATE,
        "Submissions dropped because their id was seen within the dedupe window."
    );
    describe_counter!(
        TASKS_PARKED,
        "Tasks parked in a group's wait queue because no matching group had room, by group."
    );
    describe_counter!(
        TASKS_REROUTED,
        "Tasks routed again: moved from a group without live workers to another matching group (scheduler), or sent back by a worker that does not handle their kind (worker)."
    );
    describe_counter!(
        TASKS_REFUSED,
        "Submissions refused to producers (HTTP 429/503), by reason."
    );
    describe_counter!(REDIS_MASTER_SWITCHES, "Sentinel `+switch-master` announcements for fleet's master heard by this process; each drops its Redis connections so the next call goes to the new master.");
    describe_counter!(PUBLISHER_RENEWALS, "Publishing channels opened afresh because every publish on the one before was nacked for 2 s with its queue far below any bound, by user (api, dispatch).");
    describe_counter!(REDIS_READ_ONLY, "Redis calls answered READONLY (a demoted master); each empties the connection pool so the next call reconnects (through Sentinel, to the new master).");
    describe_counter!(TASKS_REPUBLISHED, "HTTP submissions published again because their publisher confirm was lost with the connection (node loss); copies are dropped by the dedupe window.");
    describe_histogram!(
        TASK_WAIT,
        Unit::Seconds,
        "Time from submission to start, by lane."
    );
    describe_histogram!(
        TASK_RUN,
        Unit::Seconds,
        "Handler run time, by group and lane."
    );
    describe_gauge!(
        QUEUE_DEPTH,
        "Messages ready in a queue, sampled by the scheduler."
    );
    describe_gauge!(QUEUE_BOUND, "Configured maximum length of a bounded queue.");
    describe_gauge!(
        PRESSURE_STATE,
        "Backpressure state: 0 green, 1 yellow, 2 red."
    );
    describe_gauge!(
        PENDING,
        "Pending tasks: ingress backlog + parked + reserved-not-started."
    );
    describe_gauge!(
        GROUP_CAPACITY,
        "Normal-lane capacity of a group's active, alive workers."
    );
    describe_gauge!(GROUP_LOAD, "Normal-lane tasks running in a group.");
    describe_gauge!(
        GROUP_RESERVED,
        "Normal-lane tasks dispatched to a group and not yet started."
    );
    describe_gauge!(
        GROUP_BACKLOG,
        "Tasks waiting for a group and ready to run: its queue plus the park queues of its lanes not paused (autoscaling input)."
    );
    describe_gauge!(
        GROUP_BACKLOG_PAUSED,
        "Tasks waiting for a group in the park queue of a paused lane (not ready: do not scale up for them)."
    );
    describe_gauge!(
        GROUP_PAUSED,
        "Whether a group has a lane paused by an operator (1) or not (0)."
    );
    describe_gauge!(
        GROUP_OLDEST_AGE,
        "Age of the oldest task waiting for a group, in seconds (autoscaling input)."
    );
    describe_gauge!(
        SCALING_READY,
        "Tasks waiting for a group lane that could run now if there were room (autoscaling input)."
    );
    describe_gauge!(
        SCALING_BLOCKED,
        "Tasks waiting for a group lane that more workers would not run, by cause (paused, over_key_limit, not_yet_due, rate_limited)."
    );
    describe_gauge!(
        SCALING_OLDEST_READY_AGE,
        "Age of the oldest ready task of a group lane, in seconds (0 when none is ready)."
    );
    describe_gauge!(
        KEY_RUNNING,
        "Tasks of a fairness key running now: the FLEET_KEY_METRICS_TOP keys with the most tasks waiting, the rest summed under key=\"other\"."
    );
    describe_gauge!(
        KEY_WAITING,
        "Tasks of a fairness key parked waiting for room now (top keys by waiting, the rest under key=\"other\")."
    );
    describe_gauge!(
        KEY_MAX_RUNNING,
        "A fairness key's max_running in force (top keys by waiting that have one)."
    );
    describe_gauge!(
        GROUPS,
        "Groups (label sets) the fleet knows: registered and not reclaimed."
    );
    describe_counter!(GROUPS_RECLAIMED, "Departed groups reclaimed (no worker and empty queues for FLEET_GROUP_RECLAIM_AFTER_MS): keys, queues and consumers removed.");
    describe_gauge!(WORKERS, "Registered workers by state.");
    describe_counter!(
        WORKER_EVICTIONS,
        "Workers evicted by the health checker for missing heartbeats."
    );
    describe_counter!(
        WORKER_EJECTIONS,
        "Times a worker ejected itself as an outlier (error ratio over the threshold)."
    );
    describe_gauge!(
        WORKER_INFO,
        "Always 1; labels name the worker and its group."
    );
    describe_counter!(
        DISPATCH_THROTTLED,
        "Dispatches delayed by the rate limit or by Yellow pressure."
    );
    describe_gauge!(
        DELAY_CANARY_AGE,
        "Age of the newest delay canary back from the delay tiers through <ns>.delayed (seconds): about 5 while delayed tasks and retries move, growing while the delay path is stuck."
    );
    describe_histogram!(
        PROBE,
        Unit::Seconds,
        "Round trip of the scheduler's probe task through a group's critical lane."
    );
    describe_counter!(PROBES_COMPLETED, "Health probes a worker ran, by group and outcome (kept out of fleet_tasks_completed_total).");
    describe_counter!(
        PROBE_FAILURES,
        "Probe tasks that did not come back in time, by group."
    );
    describe_counter!(REDIS_ERRORS, "Failed Redis calls (retried).");
    describe_counter!(AMQP_RECONNECTS, "Reconnections to RabbitMQ.");
    describe_gauge!(
        CLOCK_SKEW,
        Unit::Seconds,
        "This process's clock minus the Redis server's (fleet's one clock), as last measured."
    );
    describe_counter!(DUPLICATE_DELIVERIES, "Deliveries of an attempt that already ran or runs elsewhere (scheduler crash, consumer timeout, lost ack), acked without running, by lane.");
    describe_counter!(
        SCHEDULE_FIRES,
        "Tasks submitted by periodic schedules, by schedule and trigger (cron, manual)."
    );
    describe_counter!(SCHEDULE_MISSES, "Schedule ticks not fired, by schedule and reason (skipped, catch_up_limit, pressure_red, ingress_full, error).");
    describe_histogram!(
        SCHEDULE_LAG,
        Unit::Seconds,
        "Time from a schedule's tick to its confirmed submission, by schedule."
    );
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Upper bounds of the buckets of every `_seconds` histogram (and of the wait-time histograms
/// workers share, [`crate::run::waits`]), in seconds (the last bucket, past 300 s, is open).
pub const SECONDS_BUCKETS: [f64; 15] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Installs the Prometheus recorder once per process and returns its handle.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
                .unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            describe();
            handle
        })
        .clone()
}
