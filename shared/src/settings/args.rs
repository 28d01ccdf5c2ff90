//! Every setting of `fleet-scheduler` and `fleet-worker`, declared once (clap derive with its
//! `env` feature): the declaration gives each setting its command-line flag `--name`, its
//! environment variable `FLEET_NAME`, its config-file key `name`, its type, its default, its
//! range check and its help text. `--help`, the error messages, the typed values the configs are
//! built from and README's settings table ([`markdown_table`], kept in step by a test) all come
//! from it.
//!
//! Precedence, highest first: command line, environment, the TOML file named by
//! `FLEET_CONFIG`, the declared default. The file and the environment are gathered into a
//! [`crate::settings::Settings`] map first; [`parse`] turns that map into `--name=value`
//! arguments ahead of the real command line (a later flag overrides an earlier one).
//!
//! Values are range-checked at parse time with messages that say what is expected ("must be a
//! positive integer"); a bad value becomes [`crate::Error::Config`] naming `FLEET_<NAME>`, and
//! the binaries exit with status 2.

use std::ffi::OsString;

use clap::{Args, CommandFactory, Parser};

use crate::error::Error;
use crate::settings::Settings;

/// Settings both daemons share.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// RabbitMQ URL (`amqp://` or `amqps://`), or a comma-separated list of a cluster's nodes: each process starts at a random node and fails over to the next. The password is never printed.
    #[arg(
        long,
        env = "FLEET_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    pub amqp_url: String,
    /// Redis URL (`redis://`), `redis+sentinel://[:password@]host:port,…/<master>[/<db>]` for a master behind Sentinel, or `redis+cluster://[:password@]host:port,…` (seed nodes) for a Redis Cluster. The password is never printed.
    #[arg(
        long,
        env = "FLEET_REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        hide_env_values = true
    )]
    pub redis_url: String,
    /// Redis Sentinels, `host:port,host:port` (instead of the `redis+sentinel://` form): the master named by FLEET_REDIS_MASTER is asked of them, with the password and db of FLEET_REDIS_URL.
    #[arg(long, env = "FLEET_REDIS_SENTINELS", default_value = "")]
    pub redis_sentinels: String,
    /// Name of the Sentinel-monitored master (with FLEET_REDIS_SENTINELS).
    #[arg(long, env = "FLEET_REDIS_MASTER", default_value = "mymaster")]
    pub redis_master: String,
    /// Prefix of every Redis key and AMQP name (letters, digits, `_`, `-`).
    #[arg(long, env = "FLEET_NAMESPACE", default_value = "fleet")]
    pub namespace: String,
    /// Log format (level from `RUST_LOG`).
    #[arg(long, env = "FLEET_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Type of the task queues.
    #[arg(long, env = "FLEET_QUEUE_TYPE", default_value = "quorum", value_parser = ["quorum", "classic"])]
    pub queue_type: String,
    /// Where a new quorum queue's leader goes (`x-queue-leader-locator`, RabbitMQ 3.10+): `balanced` spreads leaders over a cluster's nodes; `none` sets no argument. A namespace whose queues predate the argument is detected and declared without it.
    #[arg(long, env = "FLEET_QUEUE_LEADER_LOCATOR", default_value = "balanced", value_parser = ["balanced", "client-local", "none"])]
    pub queue_leader_locator: String,
    /// Largest envelope accepted, in bytes.
    #[arg(long, env = "FLEET_MAX_TASK_BYTES", default_value = "1048576", value_parser = positive::<usize>)]
    pub max_task_bytes: usize,
    /// Most label pairs in a task's selector.
    #[arg(long, env = "FLEET_MAX_LABEL_PAIRS", default_value = "16", value_parser = positive::<usize>)]
    pub max_label_pairs: usize,
    /// Longest task id, in bytes.
    #[arg(long, env = "FLEET_MAX_ID_BYTES", default_value = "200", value_parser = positive::<usize>)]
    pub max_id_bytes: usize,
    /// Longest task kind, in bytes.
    #[arg(long, env = "FLEET_MAX_KIND_BYTES", default_value = "128", value_parser = positive::<usize>)]
    pub max_kind_bytes: usize,
    /// Deepest nesting of a task's payload.
    #[arg(long, env = "FLEET_MAX_PAYLOAD_DEPTH", default_value = "32", value_parser = positive::<usize>)]
    pub max_payload_depth: usize,
    /// Bound (`x-max-length`) of the normal ingress queue; a full queue refuses publishes.
    #[arg(long, env = "FLEET_INGRESS_MAX_NORMAL", default_value = "10000", value_parser = positive::<u32>)]
    pub ingress_max_normal: u32,
    /// Bound (`x-max-length`) of the critical ingress queue.
    #[arg(long, env = "FLEET_INGRESS_MAX_CRITICAL", default_value = "1000", value_parser = positive::<u32>)]
    pub ingress_max_critical: u32,
    /// Bound of each group's normal-lane park queue (tasks waiting for room).
    #[arg(long, env = "FLEET_PARK_MAX", default_value = "100000", value_parser = positive::<u32>)]
    pub park_max: u32,
    /// Bound of each group's critical-lane park queue (small: the critical lane is no second bulk lane).
    #[arg(long, env = "FLEET_PARK_MAX_CRITICAL", default_value = "100", value_parser = positive::<u32>)]
    pub park_max_critical: u32,
    /// Fair park queues per group (normal lane) where tasks with a fairness `key` wait for room
    /// or for their key's limit: up to this many waiting keys of a group never share one
    /// (0: keyed tasks wait in the group's park queue, first in first out). At most 64.
    #[arg(long, env = "FLEET_FAIR_QUEUES", default_value = "8", value_parser = clap::value_parser!(u16).range(0..=64))]
    pub fair_queues: u16,
    /// How long task status records live in Redis, in milliseconds: from a task's end (at least 0.9 × this; a record is renewed at the end only when its TTL was set longer ago than a tenth of it); at least FLEET_DEDUPE_WINDOW_MS (the dedupe mark is a field of the record).
    #[arg(long, env = "FLEET_STATUS_TTL_MS", default_value = "86400000", value_parser = positive::<u64>)]
    pub status_ttl_ms: u64,
    /// Attempts of a task that does not say (`max_attempts` in the envelope wins).
    #[arg(long, env = "FLEET_MAX_ATTEMPTS", default_value = "5", value_parser = positive::<u32>)]
    pub max_attempts: u32,
    /// Shard queues of every group's normal lane (1: one queue, unsharded); the same on the scheduler and every worker. See README "Sharded groups".
    #[arg(long, env = "FLEET_SHARDS", default_value = "1", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub shards: u32,
    /// Shard queues each worker consumes, chosen by deterministic subsetting from its ordinal in its group; FLEET_SHARDS must be a multiple of it.
    #[arg(long, env = "FLEET_SHARDS_PER_WORKER", default_value = "1", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub shards_per_worker: u32,
    /// `amqps://`: PEM file of CA certificates trusted besides the system roots (a private CA).
    #[arg(long, env = "FLEET_AMQP_TLS_CA_FILE", value_parser = pem_certificates)]
    pub amqp_tls_ca_file: Option<String>,
    /// `amqps://`: PEM client certificate chain for mutual TLS (with FLEET_AMQP_TLS_KEY_FILE).
    #[arg(long, env = "FLEET_AMQP_TLS_CERT_FILE", value_parser = pem_certificates)]
    pub amqp_tls_cert_file: Option<String>,
    /// `amqps://`: PEM private key of the client certificate (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "FLEET_AMQP_TLS_KEY_FILE", value_parser = pem_private_key)]
    pub amqp_tls_key_file: Option<String>,
    /// `rediss://`: PEM file of CA certificates; when set, Redis is trusted through it alone.
    #[arg(long, env = "FLEET_REDIS_TLS_CA_FILE", value_parser = pem_certificates)]
    pub redis_tls_ca_file: Option<String>,
    /// `rediss://`: PEM client certificate chain for mutual TLS (with FLEET_REDIS_TLS_KEY_FILE).
    #[arg(long, env = "FLEET_REDIS_TLS_CERT_FILE", value_parser = pem_certificates)]
    pub redis_tls_cert_file: Option<String>,
    /// `rediss://`: PEM private key of the client certificate (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "FLEET_REDIS_TLS_KEY_FILE", value_parser = pem_private_key)]
    pub redis_tls_key_file: Option<String>,
    /// API bearer tokens with their names and roles, `NAME:TOKEN ROLE` (or `TOKEN ROLE`) entries separated by commas or newlines (roles read, submit, admin; admin may do all; tokens of 16+ characters), each optionally followed by `key=KEY`: every task the token submits gets that fairness key; none: the API is open.
    #[arg(
        long,
        env = "FLEET_API_TOKENS",
        default_value = "",
        hide_env_values = true
    )]
    pub api_tokens: String,
    /// File of API tokens, one `NAME:TOKEN ROLE` (or `TOKEN ROLE`) per line (`#` comments); adds to FLEET_API_TOKENS.
    #[arg(long, env = "FLEET_API_TOKENS_FILE")]
    pub api_tokens_file: Option<String>,
    /// OTLP/HTTP endpoint to export task spans to, `http(s)://host:port` (spans go to `<endpoint>/v1/traces` as protobuf, batched); unset: no spans, the default. See README "Tracing".
    #[arg(long, env = "FLEET_OTLP_ENDPOINT", value_parser = otlp_endpoint)]
    pub otlp_endpoint: Option<String>,
    /// Who may read `/metrics`: anyone, or a token with role `read`.
    #[arg(long, env = "FLEET_METRICS_AUTH", default_value = "open", value_parser = ["open", "read"])]
    pub metrics_auth: String,
    /// Serve an API without tokens on a non-loopback FLEET_HTTP_ADDR (refused otherwise).
    #[arg(long, env = "FLEET_ALLOW_UNAUTHENTICATED", default_value = "false", value_parser = boolean, action = clap::ArgAction::Set)]
    pub allow_unauthenticated: bool,
    /// Host names, comma-separated, under which an API without tokens answers besides `localhost` and IP addresses (DNS-rebinding defence: any other `Host` gets 421); `*` admits every name.
    #[arg(long, env = "FLEET_API_ALLOWED_HOSTS", default_value = "")]
    pub api_allowed_hosts: String,
}

/// `fleet-scheduler`'s settings.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "fleet-scheduler",
    version,
    about = "fleet's scheduler: admits, routes and dispatches tasks",
    args_override_self = true
)]
pub struct SchedulerArgs {
    /// The settings every binary has (clap ignores a doc comment here).
    #[command(flatten)]
    pub common: CommonArgs,
    /// Address of the API, `/metrics`, `/healthz` and `/readyz` (host:port).
    #[arg(long, env = "FLEET_HTTP_ADDR", default_value = "127.0.0.1:8080")]
    pub http_addr: String,
    /// How a group is chosen among those that match.
    #[arg(long, env = "FLEET_STRATEGY", default_value = "least_loaded", value_parser = ["least_loaded", "round_robin", "weighted"])]
    pub strategy: String,
    /// Dispatch beyond capacity, as a fraction (0-100): a group has room while running + reserved < capacity × (1 + factor).
    #[arg(long, env = "FLEET_BACKLOG_FACTOR", default_value = "1.0", value_parser = fraction_up_to_100)]
    pub backlog_factor: f64,
    /// How long a task may queue in front of a group's workers, in milliseconds: a group's room is its completion rate × this (Little's law), at least capacity × (1 + backlog factor).
    #[arg(long, env = "FLEET_TARGET_QUEUE_MS", default_value = "1000", value_parser = positive::<u64>)]
    pub target_queue_ms: u64,
    /// Lease of a capacity reservation, in milliseconds.
    #[arg(long, env = "FLEET_RESERVATION_LEASE_MS", default_value = "30000", value_parser = positive::<u64>)]
    pub reservation_lease_ms: u64,
    /// Pending work at which pressure is full: the published `pending` figure counts ingress + parked + waiting + reserved; the state (the intake gate) counts tasks waiting for a matching worker, plus parked and queued beyond a group's room in the groups whose workers are all busy or that have not drained for 2 s, and beyond four rooms in the others (work beyond what the groups drain).
    #[arg(long, env = "FLEET_MAX_PENDING", default_value = "1000", value_parser = positive::<u32>)]
    pub max_pending: u32,
    /// Pending ratio (0-1) from which pressure is Yellow.
    #[arg(long, env = "FLEET_PENDING_YELLOW", default_value = "0.7", value_parser = ratio)]
    pub pending_yellow: f64,
    /// Pending ratio (0-1) from which pressure is Red.
    #[arg(long, env = "FLEET_PENDING_RED", default_value = "0.9", value_parser = ratio)]
    pub pending_red: f64,
    /// Load ratio (0-1) from which the fleet's utilisation is reported `high` (not a pressure state: a busy fleet is healthy; below it, a fleet with nothing waiting, parked or queued beyond its rooms has run dry and its intake reopens without waiting out FLEET_PRESSURE_HOLD_MS).
    #[arg(long, env = "FLEET_LOAD_YELLOW", default_value = "0.68", value_parser = ratio)]
    pub load_yellow: f64,
    /// Load ratio (0-1) from which the fleet's utilisation is reported `full` (not a pressure state).
    #[arg(long, env = "FLEET_LOAD_RED", default_value = "0.85", value_parser = ratio)]
    pub load_red: f64,
    /// Pause between dispatch batches while Yellow, in milliseconds.
    #[arg(long, env = "FLEET_THROTTLE_MS", default_value = "500", value_parser = positive::<u64>)]
    pub throttle_ms: u64,
    /// How often a closed (Red) intake is looked at again, in milliseconds.
    #[arg(long, env = "FLEET_RED_RECHECK_MS", default_value = "2000", value_parser = positive::<u64>)]
    pub red_recheck_ms: u64,
    /// How often pressure is measured, in milliseconds.
    #[arg(long, env = "FLEET_PRESSURE_INTERVAL_MS", default_value = "250", value_parser = positive::<u64>)]
    pub pressure_interval_ms: u64,
    /// Minimum time a pressure state holds before it gives way to a lower one, in milliseconds (a higher one is entered at once; a fleet that has run dry — nothing waiting, parked or queued beyond its rooms, load below FLEET_LOAD_YELLOW — reopens at once).
    #[arg(long, env = "FLEET_PRESSURE_HOLD_MS", default_value = "1000")]
    pub pressure_hold_ms: u64,
    /// Normal-lane dispatch rate limit, tasks per second, shared by every replica (0 = off, the default; 3000 with burst 6000 is the documented example).
    #[arg(long, env = "FLEET_RATE", default_value = "0", value_parser = non_negative_number)]
    pub rate: f64,
    /// Normal-lane burst of the rate limit, tasks.
    #[arg(long, env = "FLEET_BURST", default_value = "6000", value_parser = positive::<u32>)]
    pub burst: u32,
    /// Critical-lane dispatch rate limit, tasks per second (0 = off, the default).
    #[arg(long, env = "FLEET_CRITICAL_RATE", default_value = "0", value_parser = non_negative_number)]
    pub critical_rate: f64,
    /// Critical-lane burst of the rate limit, tasks.
    #[arg(long, env = "FLEET_CRITICAL_BURST", default_value = "2000", value_parser = positive::<u32>)]
    pub critical_burst: u32,
    /// HTTP submissions per second above which the API answers 429 (0 = no limit).
    #[arg(long, env = "FLEET_SUBMIT_RATE", default_value = "0", value_parser = non_negative_number)]
    pub submit_rate: f64,
    /// Interval of the console's throughput and wait history (15 minutes kept), in milliseconds.
    #[arg(long, env = "FLEET_SERIES_INTERVAL_MS", default_value = "2000", value_parser = positive::<u64>)]
    pub series_interval_ms: u64,
    /// How often periodic schedules are looked at, in milliseconds.
    #[arg(long, env = "FLEET_SCHEDULE_POLL_MS", default_value = "200", value_parser = positive::<u64>)]
    pub schedule_poll_ms: u64,
    /// How long after its tick a periodic fire may still be submitted (then it counts as missed), in milliseconds.
    #[arg(long, env = "FLEET_SCHEDULE_TOLERANCE_MS", default_value = "10000", value_parser = positive::<u64>)]
    pub schedule_tolerance_ms: u64,
    /// How long a task id is remembered to drop duplicates, in milliseconds.
    #[arg(long, env = "FLEET_DEDUPE_WINDOW_MS", default_value = "3600000", value_parser = positive::<u64>)]
    pub dedupe_window_ms: u64,
    /// How often silent workers are looked for, in milliseconds.
    #[arg(long, env = "FLEET_HEALTH_INTERVAL_MS", default_value = "10000", value_parser = positive::<u64>)]
    pub health_interval_ms: u64,
    /// Silence after which a worker is evicted, in milliseconds.
    #[arg(long, env = "FLEET_HEARTBEAT_TIMEOUT_MS", default_value = "30000", value_parser = positive::<u64>)]
    pub heartbeat_timeout_ms: u64,
    /// How long a group (label set) must have had no worker and no task before it is reclaimed — its queues, park consumers and Redis keys removed — in milliseconds (0 = never; a worker of that group registering later recreates it).
    #[arg(long, env = "FLEET_GROUP_RECLAIM_AFTER_MS", default_value = "600000", value_parser = non_negative::<u64>)]
    pub group_reclaim_after_ms: u64,
    /// How long a task no group can ever match waits before it is dead-lettered, in milliseconds.
    #[arg(long, env = "FLEET_NO_MATCH_GRACE_MS", default_value = "60000", value_parser = positive::<u64>)]
    pub no_match_grace_ms: u64,
    /// Interval of the health probe sent through each group's critical lane, in milliseconds.
    #[arg(long, env = "FLEET_PROBE_INTERVAL_MS", default_value = "10000", value_parser = positive::<u64>)]
    pub probe_interval_ms: u64,
    /// Time after which a probe counts as failed, in milliseconds.
    #[arg(long, env = "FLEET_PROBE_TIMEOUT_MS", default_value = "5000", value_parser = positive::<u64>)]
    pub probe_timeout_ms: u64,
    /// Interval of the queue-depth and group gauges, in milliseconds.
    #[arg(long, env = "FLEET_STATS_INTERVAL_MS", default_value = "1000", value_parser = positive::<u64>)]
    pub stats_interval_ms: u64,
    /// Largest dispatch batch, tasks.
    #[arg(long, env = "FLEET_BATCH_MAX", default_value = "256", value_parser = positive::<u16>)]
    pub batch_max: u16,
    /// Concurrent dispatch loops on the normal ingress queue.
    #[arg(long, env = "FLEET_INGRESS_CONSUMERS", default_value = "4", value_parser = positive::<u16>)]
    pub ingress_consumers: u16,
    /// Fairness keys (tenants): the limits of every key, `field=value,...` of max_running, min_running, rate, burst, weight (e.g. `max_running=10,rate=20,weight=1`); a key's own spec and runtime changes (`PUT /v1/keys/*/limits`) override it. See README "Tenants (fairness keys)".
    #[arg(long, env = "FLEET_KEY_DEFAULT", default_value = "")]
    pub key_default: String,
    /// Fairness keys: each key's own limits, `KEY:field=value,...` entries separated by `;` (e.g. `acme:max_running=5,weight=3;beta:min_running=2`); a runtime change of a key (`PUT /v1/keys/{key}/limits`) replaces its entry.
    #[arg(long, env = "FLEET_KEY_LIMITS", default_value = "")]
    pub key_limits: String,
    /// Fairness keys shown one by one in the `fleet_key_*` metrics: the N with the most tasks waiting; the rest are summed under `key="other"` (bounded label values).
    #[arg(long, env = "FLEET_KEY_METRICS_TOP", default_value = "20", value_parser = positive::<usize>)]
    pub key_metrics_top: usize,
    /// Fairness keys: a key not routed for this long, with nothing parked waiting and no task reserved or running, is forgotten — its figures (dispatched, last activity) and lapsed leases leave Redis, as its token bucket expires after an hour — so the per-second key figures cost what the active keys cost, not every key ever seen; a key that comes back starts from zero (its dispatch rate reads the restart as a counter reset), in milliseconds.
    #[arg(long, env = "FLEET_KEY_FORGET_MS", default_value = "3600000", value_parser = positive::<u64>)]
    pub key_forget_ms: u64,
}

/// `fleet-worker`'s settings.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "fleet-worker",
    version,
    about = "fleet's worker: runs the tasks of its group",
    args_override_self = true
)]
pub struct WorkerArgs {
    /// The settings every binary has (clap ignores a doc comment here).
    #[command(flatten)]
    pub common: CommonArgs,
    /// Address of `/metrics`, `/healthz`, `/readyz`, `/status` and `/drain` (host:port).
    #[arg(long, env = "FLEET_HTTP_ADDR", default_value = "127.0.0.1:9100")]
    pub http_addr: String,
    /// The worker's id, 1-128 of [A-Za-z0-9_.:-] [default: hostname + random suffix].
    #[arg(long, env = "FLEET_WORKER_ID")]
    pub worker_id: Option<String>,
    /// The worker's labels, `k=v,k=v` (its executor is added as `protocol=<executor>`).
    #[arg(long, env = "FLEET_LABELS", default_value = "")]
    pub labels: String,
    /// Normal-lane concurrency (and AMQP prefetch), 1-65535.
    #[arg(long, env = "FLEET_CAPACITY", default_value = "4", value_parser = lane_capacity)]
    pub capacity: u32,
    /// Critical-lane concurrency (and AMQP prefetch), 1-65535.
    #[arg(long, env = "FLEET_CRITICAL_CAPACITY", default_value = "1", value_parser = lane_capacity)]
    pub critical_capacity: u32,
    /// http and exec executors: the task kinds this worker handles, `a,b` or `*` (every kind); the scheduler routes a task only to a group whose every active worker handles its kind (builtin: its own handler names) [default with http or exec: `*`].
    #[arg(long, env = "FLEET_KINDS")]
    pub kinds: Option<String>,
    /// How tasks are run.
    #[arg(long, env = "FLEET_EXECUTOR", default_value = "builtin", value_parser = ["builtin", "http", "exec"])]
    pub executor: String,
    /// Heartbeat interval, in milliseconds.
    #[arg(long, env = "FLEET_HEARTBEAT_INTERVAL_MS", default_value = "10000", value_parser = positive::<u64>)]
    pub heartbeat_interval_ms: u64,
    /// Silence after which a registration of the same id counts as gone, in milliseconds.
    #[arg(long, env = "FLEET_HEARTBEAT_TIMEOUT_MS", default_value = "30000", value_parser = positive::<u64>)]
    pub heartbeat_timeout_ms: u64,
    /// Lease of a running-task record, renewed by every heartbeat, in milliseconds [default: 3 × heartbeat interval].
    #[arg(long, env = "FLEET_RUN_LEASE_MS", value_parser = positive::<u64>)]
    pub run_lease_ms: Option<u64>,
    /// How long running tasks may take to finish once draining, in milliseconds.
    #[arg(long, env = "FLEET_DRAIN_GRACE_MS", default_value = "30000", value_parser = positive::<u64>)]
    pub drain_grace_ms: u64,
    /// First retry delay (exponential backoff with full jitter), in milliseconds.
    #[arg(long, env = "FLEET_RETRY_BASE_MS", default_value = "1000", value_parser = positive::<u64>)]
    pub retry_base_ms: u64,
    /// Largest retry delay, in milliseconds.
    #[arg(long, env = "FLEET_RETRY_CAP_MS", default_value = "600000", value_parser = positive::<u64>)]
    pub retry_cap_ms: u64,
    /// Cap of one run, in milliseconds (keep it under RabbitMQ's consumer_timeout).
    #[arg(long, env = "FLEET_MAX_TASK_MS", default_value = "1500000", value_parser = positive::<u64>)]
    pub max_task_ms: u64,
    /// How long a cancelled exec run has between SIGTERM to its process group and SIGKILL, in
    /// milliseconds (builtin and http runs stop at once).
    #[arg(long, env = "FLEET_CANCEL_GRACE_MS", default_value = "5000", value_parser = positive::<u64>)]
    pub cancel_grace_ms: u64,
    /// Outcomes remembered for outlier ejection.
    #[arg(long, env = "FLEET_EJECT_WINDOW", default_value = "20", value_parser = positive::<usize>)]
    pub eject_window: usize,
    /// Outcomes needed before the error ratio is trusted.
    #[arg(long, env = "FLEET_EJECT_MIN_SAMPLES", default_value = "10", value_parser = positive::<usize>)]
    pub eject_min_samples: usize,
    /// Error ratio (0-1) above which the worker ejects itself.
    #[arg(long, env = "FLEET_EJECT_ERROR_RATIO", default_value = "0.5", value_parser = ratio)]
    pub eject_error_ratio: f64,
    /// How long an ejection lasts, in milliseconds.
    #[arg(long, env = "FLEET_EJECT_COOLDOWN_MS", default_value = "30000", value_parser = positive::<u64>)]
    pub eject_cooldown_ms: u64,
    /// http executor: the endpoint tasks are POSTed to (`http://` or `https://`; required with FLEET_EXECUTOR=http).
    #[arg(long, env = "FLEET_HTTP_URL", hide_env_values = true)]
    pub http_url: Option<String>,
    /// http executor: upper bound of one request, in milliseconds.
    #[arg(long, env = "FLEET_HTTP_TIMEOUT_MS", default_value = "30000", value_parser = positive::<u64>)]
    pub http_timeout_ms: u64,
    /// http executor, `https://`: PEM file of CA certificates trusted besides the system roots.
    #[arg(long, env = "FLEET_HTTP_TLS_CA_FILE", value_parser = pem_certificates)]
    pub http_tls_ca_file: Option<String>,
    /// http executor, `https://`: PEM client certificate chain for mutual TLS (with FLEET_HTTP_TLS_KEY_FILE).
    #[arg(long, env = "FLEET_HTTP_TLS_CERT_FILE", value_parser = pem_certificates)]
    pub http_tls_cert_file: Option<String>,
    /// http executor, `https://`: PEM private key of the client certificate.
    #[arg(long, env = "FLEET_HTTP_TLS_KEY_FILE", value_parser = pem_private_key)]
    pub http_tls_key_file: Option<String>,
    /// http executor: follow redirects (at most 10); off, a 3xx answer is a failed attempt.
    #[arg(long, env = "FLEET_HTTP_FOLLOW_REDIRECTS", default_value = "false", value_parser = boolean, action = clap::ArgAction::Set)]
    pub http_follow_redirects: bool,
    /// exec executor: program and arguments, a JSON array or words, run without a shell (required with FLEET_EXECUTOR=exec).
    #[arg(long, env = "FLEET_EXEC_COMMAND")]
    pub exec_command: Option<String>,
    /// exec executor: bytes of stdout kept as the result.
    #[arg(long, env = "FLEET_EXEC_MAX_OUTPUT", default_value = "1048576", value_parser = positive::<usize>)]
    pub exec_max_output: usize,
    /// exec executor: exit code (1-255) meaning "permanent failure: do not retry".
    #[arg(long, env = "FLEET_EXEC_PERMANENT_EXIT", default_value = "65", value_parser = clap::value_parser!(i32).range(1..=255))]
    pub exec_permanent_exit: i32,
}

/// Parser of [`CommonArgs`] alone (for [`crate::settings::CommonConfig::from_settings`]).
#[derive(Debug, Clone, Parser)]
#[command(name = "fleet", args_override_self = true)]
pub struct CommonOnly {
    /// The settings every binary has (clap ignores a doc comment here).
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Variables that are fleet's but no daemon setting: `fleetctl`'s and docker compose's.
const OTHER_VARIABLES: &[&str] = &[
    "FLEET_CONFIG",
    "FLEET_API_URL",
    "FLEET_API_TOKEN",
    "FLEET_ENV_FILE",
    "FLEET_IMAGE_TAG",
    "FLEET_BIN_DIR",
];

/// What the command line asked for besides running.
pub enum Early {
    /// `--help` or `--version`: print this to stdout and exit 0.
    Print(String),
    /// Run.
    Run,
}

/// Looks at the command line alone for `--help` / `--version`, before any setting is read or
/// any connection made. Errors in the command line are left for [`parse`].
pub fn early<T: Parser>(args: &[OsString]) -> Early {
    match T::command().ignore_errors(true).try_get_matches_from(args) {
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            Early::Print(e.render().to_string())
        }
        _ => Early::Run,
    }
}

/// Parses `T` from `settings` (file and environment) with `settings`' command line on top.
/// Keys of `settings` that `T` does not declare are left out (see [`unknown`] for the
/// warnings). A bad value is an [`Error::Config`] naming the variable.
pub fn parse<T: Parser>(settings: &Settings) -> crate::Result<T> {
    let cmd = T::command();
    let mut argv: Vec<OsString> = vec![cmd.get_name().into()];
    for (key, value) in settings.pairs() {
        if value.trim().is_empty() {
            continue;
        }
        if cmd
            .get_arguments()
            .any(|a| a.get_long() == Some(flag(key).as_str()))
        {
            argv.push(format!("--{}={}", flag(key), value.trim()).into());
        }
    }
    argv.extend(settings.command_line().iter().cloned());
    T::try_parse_from(argv).map_err(|e| config_error(&cmd, &e))
}

fn flag(key: &str) -> String {
    key.to_ascii_lowercase().replace('_', "-")
}

/// A clap error as a config error naming the variable of the argument it is about.
fn config_error(cmd: &clap::Command, e: &clap::Error) -> Error {
    use clap::error::ContextKind;
    let arg = match e.get(ContextKind::InvalidArg) {
        Some(clap::error::ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    let long = arg
        .trim_start_matches("--")
        .split([' ', '='])
        .next()
        .unwrap_or("")
        .to_string();
    let setting = cmd
        .get_arguments()
        .find(|a| a.get_long() == Some(long.as_str()))
        .and_then(|a| a.get_env().map(|v| v.to_string_lossy().into_owned()))
        .unwrap_or_else(|| {
            if arg.is_empty() {
                "command line".to_string()
            } else {
                arg.clone()
            }
        });
    let rendered = e.render().to_string();
    let mut message = rendered
        .lines()
        .next()
        .unwrap_or("")
        .trim_start_matches("error: ")
        .to_string();
    // What clap says after the first line is what makes the error actionable: the valid
    // values of an enum setting ("[possible values: a, b]") and the did-you-mean of a
    // mistyped flag ("tip: a similar argument exists: '--capacity'"). Usage lines are not.
    for line in rendered.lines().skip(1).map(str::trim) {
        if let Some(values) = line
            .strip_prefix("[possible values: ")
            .and_then(|v| v.strip_suffix(']'))
        {
            message.push_str(&format!("; valid values: {values}"));
        } else if let Some(tip) = line.strip_prefix("tip: ") {
            message.push_str(&format!(" ({tip})"));
        }
    }
    Error::config(setting, crate::process::redact(&message))
}

/// Warnings for `FLEET_*` variables and config-file keys no fleet program knows, each with the
/// closest known name (Jaro-Winkler similarity, `strsim`).
pub fn unknown(settings: &Settings) -> Vec<String> {
    let known = known_variables();
    let mut out = Vec::new();
    for (key, origin) in settings.origins() {
        let var = format!("FLEET_{}", key.to_ascii_uppercase());
        if known.contains(&var) || var.ends_with("_PORT") {
            continue;
        }
        // Suggest in the form the user wrote: a file key (the variable without `FLEET_`, lower
        // case) for a key of the FLEET_CONFIG file, a variable otherwise.
        let closest = known
            .iter()
            .map(|k| (strsim::jaro_winkler(k, &var), k))
            .filter(|(score, _)| *score > 0.8)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, k)| match origin {
                crate::settings::Origin::File => format!(
                    " (did you mean `{}`?)",
                    k.trim_start_matches("FLEET_").to_ascii_lowercase()
                ),
                _ => format!(" (did you mean {k}?)"),
            })
            .unwrap_or_default();
        let what = match origin {
            crate::settings::Origin::Environment => format!("unknown variable {var} is ignored"),
            crate::settings::Origin::File => {
                format!("unknown key `{key}` in the FLEET_CONFIG file is ignored")
            }
            crate::settings::Origin::Explicit => format!("unknown setting `{key}` is ignored"),
        };
        out.push(format!("{what}{closest}"));
    }
    out
}

/// Every `FLEET_*` variable some fleet program reads.
pub fn known_variables() -> Vec<String> {
    let mut v: Vec<String> = OTHER_VARIABLES.iter().map(|s| s.to_string()).collect();
    for cmd in [SchedulerArgs::command(), WorkerArgs::command()] {
        for a in cmd.get_arguments() {
            if let Some(env) = a.get_env() {
                v.push(env.to_string_lossy().into_owned());
            }
        }
    }
    v.sort();
    v.dedup();
    v
}

/// README's settings tables, generated from the declarations: common settings, then the
/// scheduler's and the worker's own. Columns: variable, flag / file key, default, meaning.
pub fn markdown_table() -> String {
    let common: Vec<String> = CommonOnly::command()
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect();
    let mut out = String::new();
    for (title, cmd, only_common) in [
        ("Both binaries", SchedulerArgs::command(), true),
        ("`fleet-scheduler`", SchedulerArgs::command(), false),
        ("`fleet-worker`", WorkerArgs::command(), false),
    ] {
        out.push_str(&format!(
            "\n{title}:\n\n| variable | flag, file key | default | meaning |\n|---|---|---|---|\n"
        ));
        for a in cmd.get_arguments() {
            let (Some(long), Some(env)) = (a.get_long(), a.get_env()) else {
                continue;
            };
            if common.iter().any(|c| c == long) != only_common {
                continue;
            }
            let default: Vec<String> = a
                .get_default_values()
                .iter()
                .map(|d| d.to_string_lossy().into_owned())
                .collect();
            let default = match default.first() {
                Some(d) if !d.is_empty() => format!("`{d}`"),
                _ => String::new(),
            };
            let mut help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            let choices: Vec<String> = a
                .get_possible_values()
                .iter()
                .map(|p| format!("`{}`", p.get_name()))
                .collect();
            if !choices.is_empty() {
                help.push_str(&format!("; one of {}", choices.join(", ")));
            }
            out.push_str(&format!(
                "| `{}` | `--{long}`, `{}` | {default} | {} |\n",
                env.to_string_lossy(),
                long.replace('-', "_"),
                help.replace('|', "\\|")
            ));
        }
    }
    out
}

// ------------------------------------------------------------------ value parsers

/// An integer > 0 that fits `T`.
fn positive<T: TryFrom<u64>>(s: &str) -> Result<T, String> {
    let n: i128 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` must be a positive integer"))?;
    if n <= 0 {
        return Err(format!("`{s}` must be a positive integer"));
    }
    u64::try_from(n)
        .ok()
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// An integer >= 0 that fits `T`.
fn non_negative<T: TryFrom<u64>>(s: &str) -> Result<T, String> {
    let n: i128 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` must be 0 or a positive integer"))?;
    if n < 0 {
        return Err(format!("`{s}` must be 0 or a positive integer"));
    }
    u64::try_from(n)
        .ok()
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| format!("`{s}` is too large"))
}

fn lane_capacity(s: &str) -> Result<u32, String> {
    let v: u32 = positive(s)?;
    if v > u32::from(u16::MAX) {
        return Err(format!(
            "`{s}` must be at most {} (the AMQP prefetch limit)",
            u16::MAX
        ));
    }
    Ok(v)
}

fn number(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| format!("`{s}` must be a number"))
}

fn ratio(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if !(0.0..=1.0).contains(&v) {
        return Err(format!("`{s}` must be a number between 0 and 1"));
    }
    Ok(v)
}

fn non_negative_number(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if v < 0.0 {
        return Err(format!("`{s}` must not be negative"));
    }
    Ok(v)
}

/// `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`).
fn boolean(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("`{s}` must be true or false")),
    }
}

/// An OTLP/HTTP base URL: `http://` or `https://`, a host, no query or fragment.
fn otlp_endpoint(v: &str) -> Result<String, String> {
    let bad = || format!("`{v}` is not an http:// or https:// URL of an OTLP/HTTP collector");
    let url = reqwest::Url::parse(v.trim()).map_err(|_| bad())?;
    if !matches!(url.scheme(), "http" | "https")
        || url.host_str().is_none_or(str::is_empty)
        || url.query().is_some()
        || url.fragment().is_some()
    {
        return Err(bad());
    }
    Ok(v.trim().to_string())
}

/// A readable PEM file holding at least one certificate (the path is kept; the file is read
/// again, once, when the TLS settings are built).
fn pem_certificates(path: &str) -> Result<String, String> {
    crate::tls::read_certificates(path.trim()).map(|_| path.trim().to_string())
}

/// A readable PEM file holding a private key.
fn pem_private_key(path: &str) -> Result<String, String> {
    crate::tls::read_private_key(path.trim()).map(|_| path.trim().to_string())
}

fn fraction_up_to_100(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if !(0.0..=100.0).contains(&v) {
        return Err(format!("`{s}` must be a number between 0 and 100"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declarations_are_consistent() {
        SchedulerArgs::command().debug_assert();
        WorkerArgs::command().debug_assert();
        // Every argument has its variable, named after its flag.
        for cmd in [SchedulerArgs::command(), WorkerArgs::command()] {
            for a in cmd.get_arguments() {
                let Some(long) = a.get_long() else { continue };
                let env = a.get_env().map(|e| e.to_string_lossy().into_owned());
                assert_eq!(
                    env,
                    Some(format!(
                        "FLEET_{}",
                        long.replace('-', "_").to_ascii_uppercase()
                    )),
                    "{long}"
                );
            }
        }
    }

    #[test]
    fn numbers_say_what_they_expect() {
        let s = Settings::from_pairs([("capacity", "-1".to_string())]);
        let e = parse::<WorkerArgs>(&s).unwrap_err().to_string();
        assert!(
            e.contains("FLEET_CAPACITY") && e.contains("must be a positive integer"),
            "{e}"
        );
        let s = Settings::from_pairs([("pending_red", "1.5".to_string())]);
        let e = parse::<SchedulerArgs>(&s).unwrap_err().to_string();
        assert!(
            e.contains("FLEET_PENDING_RED") && e.contains("between 0 and 1"),
            "{e}"
        );
        let s = Settings::from_pairs([("strategy", "fastest".to_string())]);
        let e = parse::<SchedulerArgs>(&s).unwrap_err().to_string();
        assert!(e.contains("FLEET_STRATEGY") && e.contains("fastest"), "{e}");
    }

    /// Every enum setting's error lists its valid values (clap's "[possible values]" was cut
    /// with everything after the first line of its error).
    #[test]
    fn every_enum_setting_lists_its_values() {
        for cmd in [SchedulerArgs::command(), WorkerArgs::command()] {
            for a in cmd.get_arguments() {
                let values: Vec<String> = a
                    .get_possible_values()
                    .iter()
                    .map(|p| p.get_name().to_string())
                    .collect();
                if values.is_empty() || a.get_long().is_none() {
                    continue;
                }
                let key = a.get_long().unwrap_or("").replace('-', "_");
                let s = Settings::from_pairs([(key.as_str(), "no-such-value".to_string())]);
                let e = if cmd.get_name() == "fleet-worker" {
                    parse::<WorkerArgs>(&s).map(|_| ()).unwrap_err()
                } else {
                    parse::<SchedulerArgs>(&s).map(|_| ()).unwrap_err()
                }
                .to_string();
                assert!(
                    e.contains(&format!("valid values: {}", values.join(", "))),
                    "{key}: {e}"
                );
            }
        }
        let s = Settings::from_pairs([("strategy", "fastest".to_string())]);
        let e = parse::<SchedulerArgs>(&s).unwrap_err().to_string();
        assert!(
            e.contains("valid values: least_loaded, round_robin, weighted"),
            "{e}"
        );
    }

    /// A mistyped flag gets clap's did-you-mean.
    #[test]
    fn a_mistyped_flag_gets_a_suggestion() {
        let s = Settings::default().with_command_line(vec![
            "fleet-worker".into(),
            "--capacty".into(),
            "7".into(),
        ]);
        let e = parse::<WorkerArgs>(&s).unwrap_err().to_string();
        assert!(e.contains("--capacty") && e.contains("'--capacity'"), "{e}");
    }

    #[test]
    fn command_line_beats_settings() {
        let s = Settings::from_pairs([("capacity", "3".to_string())]).with_command_line(vec![
            "fleet-worker".into(),
            "--capacity".into(),
            "7".into(),
        ]);
        assert_eq!(parse::<WorkerArgs>(&s).unwrap().capacity, 7);
        let s = Settings::from_pairs([("capacity", "3".to_string())]);
        assert_eq!(parse::<WorkerArgs>(&s).unwrap().capacity, 3);
    }

    #[test]
    fn unknown_names_get_the_closest_known() {
        let s = Settings::from_pairs([("capacty", "8".to_string()), ("capacity", "8".to_string())]);
        let w = unknown(&s);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("capacty") && w[0].contains("FLEET_CAPACITY"),
            "{w:?}"
        );
    }

    /// A key of the FLEET_CONFIG file gets the closest file key, not a variable name.
    #[test]
    fn a_file_key_typo_suggests_the_file_key() {
        let s = Settings::from_toml("capacty = 8\n").unwrap();
        let w = unknown(&s);
        assert_eq!(
            w,
            vec!["unknown key `capacty` in the FLEET_CONFIG file is ignored (did you mean `capacity`?)".to_string()]
        );
    }

    #[test]
    fn help_and_version_are_early() {
        assert!(
            matches!(early::<WorkerArgs>(&["fleet-worker".into(), "--help".into()]), Early::Print(t) if t.contains("FLEET_CAPACITY"))
        );
        assert!(matches!(
            early::<SchedulerArgs>(&["fleet-scheduler".into(), "--version".into()]),
            Early::Print(_)
        ));
        assert!(matches!(
            early::<SchedulerArgs>(&["fleet-scheduler".into()]),
            Early::Run
        ));
    }

    /// README's settings tables are generated: this fails when they drift. To regenerate:
    /// `UPDATE_README=1 cargo test -p fleet readme_settings`.
    #[test]
    fn readme_settings_table_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
        let readme = std::fs::read_to_string(&path).unwrap();
        let (begin, end) = ("<!-- settings:begin -->", "<!-- settings:end -->");
        let (Some(a), Some(b)) = (readme.find(begin), readme.find(end)) else {
            panic!("README.md has no {begin} … {end} block");
        };
        let current = &readme[a + begin.len()..b];
        let want = markdown_table();
        if current != want {
            if std::env::var_os("UPDATE_README").is_some() {
                let updated = format!("{}{want}{}", &readme[..a + begin.len()], &readme[b..]);
                std::fs::write(&path, updated).unwrap();
            } else {
                panic!("README.md's settings table is out of date; run UPDATE_README=1 cargo test -p fleet readme_settings\nexpected:\n{want}");
            }
        }
    }
}
