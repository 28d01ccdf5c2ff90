//! `fleetctl`: submit tasks, read their status, list workers and groups, drain a worker,
//! inspect and replay dead letters.
//!
//! Submitting talks to RabbitMQ directly (exchange `<ns>.submit`, routing key = lane,
//! persistent, publisher confirms pipelined in windows), exactly as any producer would; the
//! read and drain commands use the scheduler's HTTP API.

/// `println!` that ends the process quietly (exit 0) when the reader went away (`fleetctl
/// submit --print-ids | head -1`: a closed pipe is the reader's choice, not an error) instead
/// of panicking on `EPIPE` as `println!` does; other write errors (a full disk behind a
/// redirect) are ignored.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
        }
    }};
}

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use lapin::types::ShortString;
use lapin::Connection;
use serde_json::Value;

use fleet::broker::dead;
use fleet::broker::{Pacing, Producer, Submitted};
use fleet::registry::WorkerView;
use fleet::{Envelope, Labels, Lane, Names, Store};

/// Largest `--delay-ms`: 30 days, the envelope's bound on `not_before`.
const MAX_DELAY_MS: u64 = 30 * 24 * 3600 * 1000;
/// Largest `--timeout-ms`: 365 days.
const MAX_TIMEOUT_MS: u64 = 365 * 24 * 3600 * 1000;

/// Heading of the options every subcommand takes (connections, namespace, TLS), so that a
/// subcommand's help lists its own options first.
const GLOBAL: &str = "Global options (every subcommand; each also from its environment variable)";

#[derive(Parser)]
#[command(
    name = "fleetctl",
    version,
    about = "Control a fleet: submit tasks, read status, list workers and groups, drain, dead letters, schedules",
    after_help = "Every option has a default: none of the global options is required. The API token is read from FLEET_API_TOKEN only (a flag would show in the process list)."
)]
struct Cli {
    /// RabbitMQ URL, or a cluster's nodes `amqp://u:p@h1,h2:5672/vhost` (submit, dead,
    /// delete-namespace).
    #[arg(
        long,
        env = "FLEET_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true,
        help_heading = GLOBAL
    )]
    amqp_url: String,
    /// Redis, used by `dead list` and `dead replay` (the dead queue's reader lease; a replay's
    /// per-id claim, which clears the dedupe mark) and `delete-namespace`. With FLEET_REDIS_SENTINELS it carries only the password and db.
    #[arg(
        long,
        env = "FLEET_REDIS_URL",
        default_value = "redis://127.0.0.1:6379",
        global = true,
        hide_env_values = true,
        help_heading = GLOBAL
    )]
    redis_url: String,
    /// Redis Sentinels `host:port,host:port`, asked for the master FLEET_REDIS_MASTER (as the
    /// daemons do); empty = no Sentinel.
    #[arg(
        long,
        env = "FLEET_REDIS_SENTINELS",
        default_value = "",
        hide_default_value = true,
        global = true,
        hide_env_values = true,
        help_heading = GLOBAL
    )]
    redis_sentinels: String,
    /// Name of the Sentinel-monitored master (with FLEET_REDIS_SENTINELS).
    #[arg(
        long,
        env = "FLEET_REDIS_MASTER",
        default_value = "mymaster",
        global = true,
        hide_env_values = true,
        help_heading = GLOBAL
    )]
    redis_master: String,
    /// Namespace: the prefix of every AMQP name and Redis key of the fleet, as its scheduler
    /// and workers have it.
    #[arg(
        long,
        env = "FLEET_NAMESPACE",
        default_value = "fleet",
        global = true,
        hide_env_values = true,
        help_heading = GLOBAL
    )]
    namespace: String,
    /// Shard queues of every group's normal lane, as the namespace's scheduler and workers
    /// have it (their FLEET_SHARDS): `delete-namespace` deletes that many per group (1..=1024).
    #[arg(long, env = "FLEET_SHARDS", default_value = "1", global = true, hide_env_values = true, help_heading = GLOBAL, value_parser = clap::value_parser!(u32).range(1..=1024))]
    shards: u32,
    /// The scheduler's HTTP API (status, workers, groups, drain, schedule). Its bearer token
    /// comes from FLEET_API_TOKEN: role `read` for status, workers and groups, `admin` for
    /// drain and schedule changes.
    #[arg(
        long,
        env = "FLEET_API_URL",
        default_value = "http://127.0.0.1:8080",
        global = true,
        hide_env_values = true,
        help_heading = GLOBAL
    )]
    api: String,
    /// PEM CA file for `amqps://` (default: the system roots).
    #[arg(long, env = "FLEET_AMQP_TLS_CA_FILE", global = true, hide_env_values = true, help_heading = GLOBAL)]
    amqp_tls_ca_file: Option<String>,
    /// PEM client certificate for `amqps://` (mutual TLS, with the key).
    #[arg(long, env = "FLEET_AMQP_TLS_CERT_FILE", global = true, hide_env_values = true, help_heading = GLOBAL)]
    amqp_tls_cert_file: Option<String>,
    /// PEM client key for `amqps://`.
    #[arg(long, env = "FLEET_AMQP_TLS_KEY_FILE", global = true, hide_env_values = true, help_heading = GLOBAL)]
    amqp_tls_key_file: Option<String>,
    /// PEM CA file for `rediss://` (default: the system roots).
    #[arg(long, env = "FLEET_REDIS_TLS_CA_FILE", global = true, hide_env_values = true, help_heading = GLOBAL)]
    redis_tls_ca_file: Option<String>,
    /// PEM client certificate for `rediss://` (mutual TLS, with the key).
    #[arg(long, env = "FLEET_REDIS_TLS_CERT_FILE", global = true, hide_env_values = true, help_heading = GLOBAL)]
    redis_tls_cert_file: Option<String>,
    /// PEM client key for `rediss://`.
    #[arg(long, env = "FLEET_REDIS_TLS_KEY_FILE", global = true, hide_env_values = true, help_heading = GLOBAL)]
    redis_tls_key_file: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// A task's lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LaneArg {
    /// The default lane; held back while the intake gate is Red.
    Normal,
    /// Its own queue and worker capacity, never held back by normal-lane pressure.
    Critical,
}

impl LaneArg {
    fn lane(self) -> Lane {
        match self {
            LaneArg::Normal => Lane::Normal,
            LaneArg::Critical => Lane::Critical,
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Publish tasks to `<ns>.submit` with publisher confirms; prints `accepted=N refused=M`
    /// (exit 1 when any was refused). With --paced, waits for room instead of refusing.
    #[command(override_usage = "fleetctl submit [OPTIONS] <--kind <KIND>|--file <FILE>>")]
    Submit(SubmitArgs),
    /// Show a task's status (GET /v1/tasks/{id}).
    #[command(override_usage = "fleetctl status [OPTIONS] <ID>")]
    Status {
        /// The task's id.
        id: String,
        /// Poll until the task ends: succeeded, dead, expired or cancelled.
        #[arg(long)]
        wait: bool,
        /// With --wait: give up after this many seconds (1..=86400).
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
        timeout_s: u64,
    },
    /// List workers (GET /v1/workers).
    Workers,
    /// List groups (GET /v1/groups).
    Groups,
    /// Drain a worker: it finishes its tasks, takes no new ones, and exits.
    #[command(override_usage = "fleetctl drain [OPTIONS] <ID>")]
    Drain {
        /// The worker's id (FLEET_WORKER_ID).
        id: String,
    },
    /// Cancel a task (POST /v1/tasks/{id}/cancel, role admin): not yet running, it never
    /// runs; running, it is stopped on its worker. Never retried, never dead-lettered. Exit 0
    /// when cancelled (now or before), 1 when it had ended already or is unknown.
    #[command(override_usage = "fleetctl cancel [OPTIONS] <ID> [--reason R]")]
    Cancel {
        /// The task's id.
        id: String,
        /// Why (kept in the task's status and attempt log).
        #[arg(long)]
        reason: Option<String>,
    },
    /// Pause a group (both lanes), one lane of a group (--lane), a kind, a key or a batch on
    /// every group (POST /v1/pauses, role admin). Durable: it holds across scheduler restarts and Redis
    /// loss. Its tasks stay in the broker, reported as paused; tasks already in the group's
    /// queue still run. Exit 0 when paused (now or before).
    #[command(subcommand)]
    Pause(PauseCmd),
    /// Resume what `fleetctl pause` paused (POST /v1/pauses/resume, role admin); resuming a
    /// group resumes its lanes too. Exit 0 when resumed (or not paused).
    #[command(subcommand)]
    Resume(PauseCmd),
    /// List the pauses in force (GET /v1/pauses): scope, target, since, by, reason, and for a
    /// kind or a batch the tasks held.
    Pauses,
    /// List the fairness keys (GET /v1/keys, role read): per key its tasks running, reserved,
    /// waiting and dispatched, and its limits in force; most waiting first.
    Keys,
    /// Set a fairness key's limits, or the default spec with --default (PUT
    /// /v1/keys/{key}/limits, role admin). Durable and audited; the spec given replaces the
    /// key's settings spec (fields left out fall back to the default spec); --clear gives the
    /// key its settings spec again. Exit 0 when in force (now or before).
    #[command(
        override_usage = "fleetctl key-limit <KEY|--default> [--max-running N] [--min-running N] [--rate R] [--burst B] [--weight W] [--clear] [--reason R]"
    )]
    KeyLimit(KeyLimitArgs),
    /// List tasks by state (GET /v1/tasks): the counts per state of every task matching the
    /// filters, then the newest matching tasks (newest first). Exit 0.
    #[command(
        override_usage = "fleetctl tasks [--state S] [--group G] [--kind K] [--label k=v] [--since T] [--until T] [--limit N] [--cursor C]"
    )]
    Tasks {
        #[command(flatten)]
        filter: TaskFilter,
        /// Show at most this many tasks (1..=1000).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Start after this place (the `next:` a previous listing printed).
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Cancel, retry (dead, expired or cancelled: replayed as a new run) or delete (dead letters) many
    /// tasks by ids or by filters (POST /v1/tasks/bulk). Always asks a dry run first and prints
    /// its count and a sample; acts only with --yes, then prints applied / skipped / failed
    /// (exit 1 when any failed).
    #[command(subcommand)]
    Bulk(BulkCmd),
    /// Inspect or replay dead letters (`<ns>.dead`).
    #[command(subcommand)]
    Dead(DeadCmd),
    /// The audit log (GET /v1/audit, role read): every operator action, newest first, with
    /// the token's name and role, the time, the target or query and the count. Kept as long as
    /// the control stream keeps records (7 days).
    Audit {
        /// Only this action (cancel, drain, replay, pause, resume, bulk_cancel, schedule_add, ...).
        #[arg(long)]
        action: Option<String>,
        /// Only this token name.
        #[arg(long)]
        by: Option<String>,
        /// Not before this time (RFC 3339, e.g. 2026-12-03T10:00:00Z).
        #[arg(long)]
        since: Option<String>,
        /// Show at most this many (1..=1000).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
    },
    /// Delete a namespace: its queues (with their tasks), its exchanges and its Redis keys.
    /// Stop its scheduler and workers first. Finds every group's queues through the broker's
    /// queue catalog `<ns>.catalog`, whatever Redis holds.
    #[command(override_usage = "fleetctl delete-namespace [OPTIONS] --yes")]
    DeleteNamespace {
        /// Required: the queues' tasks are lost.
        #[arg(long)]
        yes: bool,
    },
    /// Periodic schedules (the scheduler's /v1/schedules).
    #[command(subcommand)]
    Schedule(ScheduleCmd),
    /// Batches (POST /v1/batches submits one; see README "Batches").
    #[command(subcommand)]
    Batch(BatchCmd),
}

/// What `fleetctl batch` does.
#[derive(Subcommand)]
enum BatchCmd {
    /// A batch's progress (GET /v1/batches/{id}, role read): total, succeeded, dead, expired,
    /// cancelled, pending, the ids waiting for their `after`, the failed ids and the callbacks
    /// fired. Exit 0 when known, 1 when unknown.
    #[command(override_usage = "fleetctl batch status <ID>")]
    Status {
        /// The batch id.
        id: String,
    },
    /// Cancel a batch as a whole (POST /v1/batches/{id}/cancel, role admin): its callbacks
    /// never fire, its waiting members are never released, and every member not yet ended is
    /// cancelled (not yet running: it never runs; running: it is stopped). Durable and audited.
    /// Exit 0 when cancelled (now or before), 1 when every member had ended or it is unknown.
    #[command(override_usage = "fleetctl batch cancel <ID> [--reason R]")]
    Cancel {
        /// The batch id.
        id: String,
        /// Why (kept with the batch's cancel and each member's).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// What `fleetctl pause` and `fleetctl resume` act on.
#[derive(Subcommand)]
enum PauseCmd {
    /// A group (its name as `fleetctl groups` shows it), or one lane of it with --lane.
    #[command(
        override_usage = "fleetctl pause|resume group [OPTIONS] <GROUP> [--lane L] [--reason R]"
    )]
    Group {
        /// The group's name (its label set, e.g. `gpu=true,protocol=builtin`).
        group: String,
        /// Only this lane of the group.
        #[arg(long, value_parser = ["normal", "critical"])]
        lane: Option<String>,
        /// Why (kept with the pause; ignored by resume).
        #[arg(long)]
        reason: Option<String>,
    },
    /// A task kind, on every group.
    #[command(override_usage = "fleetctl pause|resume kind [OPTIONS] <KIND> [--reason R]")]
    Kind {
        /// The kind.
        kind: String,
        /// Why (kept with the pause; ignored by resume).
        #[arg(long)]
        reason: Option<String>,
    },
    /// A fairness key (tenant), on every group: its tasks wait.
    #[command(override_usage = "fleetctl pause|resume key [OPTIONS] <KEY> [--reason R]")]
    Key {
        /// The key (1-64 of A-Z a-z 0-9 _ . : @ / -).
        key: String,
        /// Why (kept with the pause; ignored by resume).
        #[arg(long)]
        reason: Option<String>,
    },
    /// A batch: its members wait in its hold queue, its waiting members are not released and
    /// its callbacks wait until the resume.
    #[command(override_usage = "fleetctl pause|resume batch [OPTIONS] <BATCH> [--reason R]")]
    Batch {
        /// The batch id.
        batch: String,
        /// Why (kept with the pause; ignored by resume).
        #[arg(long)]
        reason: Option<String>,
    },
}

/// What `fleetctl key-limit` sets.
#[derive(Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["key", "default"])))]
struct KeyLimitArgs {
    /// The key whose limits are set.
    key: Option<String>,
    /// Set the default spec (every key's fields its own spec leaves unset) instead of a key's.
    #[arg(long)]
    default: bool,
    /// Most tasks of the key running or reserved at once, cluster-wide (0 holds them all).
    #[arg(long)]
    max_running: Option<u32>,
    /// Tasks of the key served first while it has work (a guaranteed share).
    #[arg(long)]
    min_running: Option<u32>,
    /// Dispatches per second (token bucket).
    #[arg(long)]
    rate: Option<f64>,
    /// The rate's bucket size, tasks [default: max(1, ceil(rate))].
    #[arg(long)]
    burst: Option<u32>,
    /// Share of a full group's room relative to other keys (default 1).
    #[arg(long)]
    weight: Option<f64>,
    /// Clear the runtime spec: the key gets its settings' spec (FLEET_KEY_LIMITS) again.
    #[arg(long, conflicts_with_all = ["max_running", "min_running", "rate", "burst", "weight"])]
    clear: bool,
    /// Why (kept in the audit log).
    #[arg(long)]
    reason: Option<String>,
}

#[derive(Args)]
struct SubmitArgs {
    /// Handler name: the task goes to a worker whose executor handles it (builtin: noop,
    /// echo, sleep, fail, cpu).
    #[arg(long, required_unless_present = "file", conflicts_with = "file")]
    kind: Option<String>,
    /// How many tasks to submit (1..=1000000).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    count: u32,
    /// Selector `k=v,k=v`: every pair must be on the worker.
    #[arg(long)]
    labels: Option<String>,
    /// Payload (JSON).
    #[arg(long)]
    payload: Option<String>,
    /// The task's lane.
    #[arg(long, value_enum, default_value_t = LaneArg::Normal)]
    lane: LaneArg,
    /// Task id (idempotency key); with --count N the ids are ID-1 … ID-N.
    #[arg(long)]
    id: Option<String>,
    /// Executor the task needs (builtin, http, exec).
    #[arg(long)]
    protocol: Option<String>,
    /// Runs before the task is dead (1..=1000; default: the scheduler's FLEET_MAX_ATTEMPTS).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
    max_attempts: Option<u32>,
    /// Deadline, milliseconds from now (1 ms to 365 days).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_MS))]
    timeout_ms: Option<u64>,
    /// Start no earlier than this many milliseconds from now (at most 30 days, the envelope's limit).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_DELAY_MS))]
    delay_ms: Option<u64>,
    /// Envelopes from a file: a JSON array, or one JSON object per line.
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// Print each accepted task id on its own line before the summary.
    #[arg(long)]
    print_ids: bool,
    /// Slow down to the fleet's pace instead of reporting refusals: refused tasks are offered
    /// again with backoff and jitter until every one is accepted (or --within passes).
    #[arg(long)]
    paced: bool,
    /// With --paced: give up on tasks still refused after this long (e.g. 90s, 10m; default 10m).
    #[arg(long, requires = "paced", value_parser = humantime::parse_duration)]
    within: Option<Duration>,
}

#[derive(Subcommand)]
enum BulkCmd {
    /// Cancel tasks not yet ended (they never run, or are stopped).
    #[command(
        override_usage = "fleetctl bulk cancel [filters | --ids ID,...] [--dry-run] [--yes] [--reason R]"
    )]
    Cancel(BulkArgs),
    /// Retry dead, expired or cancelled tasks: replayed as new runs — a dead or expired one from
    /// its dead letter (`<ns>.dead`), a cancelled one from the copy kept in `<ns>.cancelled`.
    #[command(override_usage = "fleetctl bulk retry [filters | --ids ID,...] [--dry-run] [--yes]")]
    Retry(BulkArgs),
    /// Delete dead letters of dead or expired tasks for good (their status records go too).
    #[command(
        override_usage = "fleetctl bulk delete [filters | --ids ID,...] [--dry-run] [--yes]"
    )]
    Delete(BulkArgs),
}

/// The filters of `fleetctl tasks` and `fleetctl bulk` (those of GET /v1/tasks).
#[derive(Debug, clap::Args)]
struct TaskFilter {
    /// Only tasks in this state (repeat or comma-separate for several).
    #[arg(long, value_delimiter = ',')]
    state: Vec<String>,
    /// Only tasks of this group.
    #[arg(long)]
    group: Option<String>,
    /// Only tasks of this kind.
    #[arg(long)]
    kind: Option<String>,
    /// Only tasks whose selector holds this key=value (repeat for several).
    #[arg(long, value_delimiter = ',')]
    label: Vec<String>,
    /// Only runs submitted at or after this time (RFC 3339 or Unix ms).
    #[arg(long)]
    since: Option<String>,
    /// Only runs submitted at or before this time (RFC 3339 or Unix ms).
    #[arg(long)]
    until: Option<String>,
}

impl TaskFilter {
    /// As query pairs.
    fn pairs(&self) -> Vec<(&'static str, String)> {
        let mut p: Vec<(&'static str, String)> = Vec::new();
        if !self.state.is_empty() {
            p.push(("state", self.state.join(",")));
        }
        for l in &self.label {
            p.push(("label", l.clone()));
        }
        for (k, v) in [
            ("group", &self.group),
            ("kind", &self.kind),
            ("since", &self.since),
            ("until", &self.until),
        ] {
            if let Some(v) = v {
                p.push((k, v.clone()));
            }
        }
        p
    }

    /// As a bulk body's `query` object.
    fn query(&self) -> Value {
        let mut m = serde_json::Map::new();
        if !self.state.is_empty() {
            m.insert("state".into(), serde_json::json!(self.state));
        }
        if !self.label.is_empty() {
            m.insert("label".into(), serde_json::json!(self.label));
        }
        for (k, v) in [
            ("group", &self.group),
            ("kind", &self.kind),
            ("since", &self.since),
            ("until", &self.until),
        ] {
            if let Some(v) = v {
                m.insert(k.into(), Value::String(v.clone()));
            }
        }
        Value::Object(m)
    }
}

#[derive(Debug, clap::Args)]
struct BulkArgs {
    #[command(flatten)]
    filter: TaskFilter,
    /// These task ids instead of filters (comma-separated or repeated).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["state", "group", "kind", "label", "since", "until"])]
    ids: Vec<String>,
    /// Only show what would be done (count and a sample).
    #[arg(long, conflicts_with = "yes")]
    dry_run: bool,
    /// Act without asking (required to act: fleetctl does not prompt).
    #[arg(long)]
    yes: bool,
    /// Act on at most this many tasks (1..=100000).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    limit: u32,
    /// Why (a cancel's reason, kept in each task's status).
    #[arg(long)]
    reason: Option<String>,
}

#[derive(Subcommand)]
enum DeadCmd {
    /// Show dead letters without removing them.
    List {
        /// Show at most this many (1..=100000).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        limit: u32,
    },
    /// Send dead letters back to `<ns>.submit` as new submissions, attempt 0 (removed from the dead queue).
    #[command(override_usage = "fleetctl dead replay [OPTIONS] <ID|--all>")]
    Replay {
        /// The task to replay.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<String>,
        /// Replay every dead letter.
        #[arg(long)]
        all: bool,
        /// The producer's size limit, as the scheduler has it: a letter still over it without
        /// fleet's own fields (an `oversized` one) is not replayed — it would die again.
        #[arg(long, env = "FLEET_MAX_TASK_BYTES", hide_env_values = true, default_value_t = 1_048_576, value_parser = clap::value_parser!(u64).range(1..))]
        max_task_bytes: u64,
        /// The status TTL, as the scheduler has it (how long a replay's claim of an id lives).
        #[arg(long, env = "FLEET_STATUS_TTL_MS", hide_env_values = true, default_value_t = 86_400_000, value_parser = clap::value_parser!(u64).range(1..))]
        status_ttl_ms: u64,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!(
                "fleetctl: {}",
                fleet::process::escape_controls(&fleet::process::redact(&format!("{e:#}")))
            );
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    let names = Names::new(&cli.namespace);
    match &cli.cmd {
        Cmd::Submit(a) => submit(&cli, &names, a).await,
        Cmd::Status {
            id,
            wait,
            timeout_s,
        } => status(&cli, id, *wait, Duration::from_secs(*timeout_s)).await,
        Cmd::Workers => workers(&cli).await,
        Cmd::Groups => groups(&cli).await,
        Cmd::Drain { id } => drain(&cli, id).await,
        Cmd::Cancel { id, reason } => cancel(&cli, id, reason.as_deref()).await,
        Cmd::Pause(what) => pause(&cli, what, true).await,
        Cmd::Resume(what) => pause(&cli, what, false).await,
        Cmd::Pauses => pauses(&cli).await,
        Cmd::Keys => keys(&cli).await,
        Cmd::Batch(BatchCmd::Status { id }) => batch_status(&cli, id).await,
        Cmd::Batch(BatchCmd::Cancel { id, reason }) => {
            batch_cancel(&cli, id, reason.as_deref()).await
        }
        Cmd::KeyLimit(a) => key_limit(&cli, a).await,
        Cmd::Tasks {
            filter,
            limit,
            cursor,
        } => tasks(&cli, filter, *limit, cursor.as_deref()).await,
        Cmd::Bulk(BulkCmd::Cancel(a)) => bulk(&cli, "cancel", a).await,
        Cmd::Bulk(BulkCmd::Retry(a)) => bulk(&cli, "retry", a).await,
        Cmd::Bulk(BulkCmd::Delete(a)) => bulk(&cli, "delete", a).await,
        Cmd::Audit {
            action,
            by,
            since,
            limit,
        } => {
            audit(
                &cli,
                action.as_deref(),
                by.as_deref(),
                since.as_deref(),
                *limit,
            )
            .await
        }
        Cmd::Dead(DeadCmd::List { limit }) => dead_list(&cli, &names, *limit).await,
        Cmd::Dead(DeadCmd::Replay {
            id,
            all,
            max_task_bytes,
            status_ttl_ms,
        }) => {
            let limits = dead::ReplayLimits {
                max_bytes: usize::try_from(*max_task_bytes).unwrap_or(usize::MAX),
                status_ttl: Duration::from_millis(*status_ttl_ms),
            };
            dead_replay(&cli, &names, id.as_deref(), *all, &limits).await
        }
        Cmd::DeleteNamespace { yes } => delete_namespace(&cli, &names, *yes).await,
        Cmd::Schedule(c) => schedule(&cli, c).await,
    }
}

// ---- delete-namespace ----

async fn delete_namespace(cli: &Cli, names: &Names, yes: bool) -> Result<ExitCode> {
    if !yes {
        bail!("this deletes every queue (and task), exchange and Redis key of namespace `{}`: add --yes", cli.namespace);
    }
    let store = store(cli, names)?;
    // Redis names the groups its registry still knows; the broker's queue catalog names every
    // group whose queues were ever declared (after a Redis loss, or declared while Redis was
    // unreachable, only it does): both are deleted.
    let redis_groups = store
        .group_names()
        .await
        .context("reading the namespace's groups from Redis (FLEET_REDIS_URL)")?;
    let conn = connect(cli).await?;
    let deleted =
        fleet::broker::topology::delete_namespace(&conn, names, &redis_groups, cli.shards)
            .await
            .with_context(|| format!("deleting the queues of namespace {}", cli.namespace));
    let _ = conn.close(200, ShortString::from("bye")).await;
    let deleted = deleted?;
    store
        .delete_namespace()
        .await
        .context("deleting the namespace's Redis keys")?;
    let only = if deleted.catalog_only > 0 {
        format!(
            " ({} known only to the broker's queue catalog, not to Redis)",
            deleted.catalog_only
        )
    } else {
        String::new()
    };
    out!(
        "namespace {}: deleted the queues of {} group(s){only}, the exchanges and the Redis keys",
        cli.namespace,
        deleted.groups.len()
    );
    if deleted.catalog.unreadable > 0 {
        eprintln!(
            "fleetctl: {} unreadable record(s) in {} were skipped",
            deleted.catalog.unreadable,
            names.catalog_queue()
        );
    }
    Ok(ExitCode::SUCCESS)
}

// ---- submit ----

async fn submit(cli: &Cli, names: &Names, a: &SubmitArgs) -> Result<ExitCode> {
    let envelopes = match &a.file {
        Some(path) => read_file(path)?,
        None => build(a)?,
    };
    let tls = amqp_tls(cli)?;
    let producer = Producer::connect_with(&cli.amqp_url, names.clone(), "fleetctl", &tls)
        .await
        .context("connecting to RabbitMQ (FLEET_AMQP_URL)")?;
    let (ids, refused) = if a.paced {
        let within = a.within.unwrap_or(Duration::from_secs(600));
        let bar = indicatif::ProgressBar::new(envelopes.len() as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} accepted {pos}/{len} [{bar:30}] {elapsed} (round {msg})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        // Only on a terminal (indicatif hides itself otherwise); stdout stays the summary.
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        let report = producer
            .submit_paced(&envelopes, within, Pacing::default(), |p| {
                bar.set_position(p.accepted as u64);
                bar.set_message(p.rounds.to_string());
            })
            .await;
        bar.finish_and_clear();
        let report = report.context("publishing")?;
        for (id, why) in &report.refused {
            eprintln!(
                "fleetctl: {id} still refused after {} ({why})",
                humantime::format_duration(within)
            );
        }
        (report.accepted, report.refused.len())
    } else {
        let answers = producer.submit(&envelopes).await.context("publishing")?;
        let mut ids = Vec::new();
        let mut refused = 0usize;
        for (env, a) in envelopes.iter().zip(answers) {
            match a {
                Submitted::Accepted => ids.push(env.id.clone()),
                Submitted::Refused(why) => {
                    eprintln!("fleetctl: {} refused: {why}", env.id);
                    refused += 1;
                }
            }
        }
        (ids, refused)
    };
    producer.close().await;
    if a.print_ids {
        for id in &ids {
            out!("{id}");
        }
    }
    out!("accepted={} refused={refused}", ids.len());
    Ok(if refused > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Envelopes from the flags.
fn build(a: &SubmitArgs) -> Result<Vec<Envelope>> {
    let kind = a
        .kind
        .clone()
        .ok_or_else(|| anyhow!("--kind is required"))?;
    let payload: Value = match &a.payload {
        Some(p) => serde_json::from_str(p).context("--payload is not valid JSON")?,
        None => Value::Null,
    };
    let labels = match &a.labels {
        Some(l) => Labels::parse(l).map_err(|e| anyhow!("--labels: {e}"))?,
        None => Labels::default(),
    };
    let lane = a.lane.lane();
    if a.count == 0 {
        bail!("--count must be at least 1");
    }
    let not_before = a.delay_ms.map(|ms| {
        chrono::Utc::now()
            + chrono::Duration::milliseconds(i64::try_from(ms).unwrap_or(i64::MAX / 2))
    });
    let mut out = Vec::with_capacity(a.count as usize);
    for i in 1..=a.count {
        let mut e = Envelope::new(kind.clone(), payload.clone());
        if let Some(id) = &a.id {
            e.id = if a.count == 1 {
                id.clone()
            } else {
                format!("{id}-{i}")
            };
        }
        e.labels = labels.clone();
        e.protocol = a.protocol.clone();
        e.lane = lane;
        e.max_attempts = a.max_attempts;
        e.timeout_ms = a.timeout_ms;
        e.not_before = not_before;
        // The same checks the scheduler makes, so a mistake is reported here.
        let e = Envelope::from_value(e.to_value()).map_err(|r| anyhow!("invalid task: {r}"))?;
        out.push(e);
    }
    Ok(out)
}

/// Envelopes from a JSON array or NDJSON file; each is checked like the scheduler does.
fn read_file(path: &std::path::Path) -> Result<Vec<Envelope>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let values: Vec<Value> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text)
            .with_context(|| format!("{}: not a JSON array", path.display()))?
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(n, l)| {
                serde_json::from_str(l)
                    .with_context(|| format!("{}:{}: invalid JSON", path.display(), n + 1))
            })
            .collect::<Result<_>>()?
    };
    values
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            Envelope::from_value(v).map_err(|r| anyhow!("{}: task {}: {r}", path.display(), i + 1))
        })
        .collect()
}

// ---- API reads ----

/// The API client, sending `FLEET_API_TOKEN` as a bearer token when set. The token is read
/// from the environment only, never from a flag: a flag would show in the process list.
fn http() -> Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    let token = match std::env::var("FLEET_API_TOKEN") {
        Ok(t) => t,
        Err(std::env::VarError::NotPresent) => String::new(),
        Err(std::env::VarError::NotUnicode(_)) => bail!("FLEET_API_TOKEN: not valid UTF-8"),
    };
    let token = token.trim();
    if !token.is_empty() {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| anyhow!("FLEET_API_TOKEN: not a valid header value"))?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    fleet::tls::install_crypto_provider();
    reqwest::Client::builder()
        .use_rustls_tls()
        .default_headers(headers)
        .timeout(Duration::from_secs(10))
        .build()
        .context("http client")
}

/// TLS settings of `FLEET_AMQP_TLS` or `FLEET_REDIS_TLS` from the flags, validated like the
/// daemons' (errors name the setting).
fn tls(var_prefix: &str, files: [&Option<String>; 3]) -> Result<fleet::tls::TlsConfig> {
    let [ca, cert, key] = files.map(|f| f.as_deref().map(str::trim).filter(|p| !p.is_empty()));
    Ok(fleet::tls::TlsConfig::from_files(
        var_prefix, ca, cert, key,
    )?)
}

/// The `FLEET_AMQP_TLS_*` settings, for every AMQP connection fleetctl makes.
fn amqp_tls(cli: &Cli) -> Result<fleet::tls::TlsConfig> {
    tls(
        "FLEET_AMQP_TLS",
        [
            &cli.amqp_tls_ca_file,
            &cli.amqp_tls_cert_file,
            &cli.amqp_tls_key_file,
        ],
    )
}

/// The Redis URL, built like the daemons': FLEET_REDIS_URL, or with FLEET_REDIS_SENTINELS the
/// `redis+sentinel://` form naming FLEET_REDIS_MASTER ([`fleet::settings::redis_url`]).
fn redis_url(cli: &Cli) -> Result<String> {
    Ok(fleet::settings::redis_url(
        &cli.redis_url,
        &cli.redis_sentinels,
        &cli.redis_master,
    )?)
}

/// The Redis store, over TLS for `rediss://` with the `FLEET_REDIS_TLS_*` files.
fn store(cli: &Cli, names: &Names) -> Result<Store> {
    let redis_tls = tls(
        "FLEET_REDIS_TLS",
        [
            &cli.redis_tls_ca_file,
            &cli.redis_tls_cert_file,
            &cli.redis_tls_key_file,
        ],
    )?;
    Ok(Store::with_tls(
        &redis_url(cli)?,
        names.clone(),
        &redis_tls,
    )?)
}

/// A request to the API that got no answer. When the API cannot be reached (connection
/// refused, no route, timed out) the error names the setting to fix: FLEET_API_URL (`--api`).
fn api_send_error(e: reqwest::Error, method: &str, url: &str) -> anyhow::Error {
    if e.is_connect() || e.is_timeout() {
        // The innermost cause ("Connection refused (os error 111)") says why.
        let mut cause: &dyn std::error::Error = &e;
        while let Some(next) = cause.source() {
            cause = next;
        }
        let why = if e.is_timeout() && !e.is_connect() {
            "no answer within 10 s".to_string()
        } else {
            cause.to_string()
        };
        anyhow!(
            "cannot reach the scheduler's API for {method} {url} ({why}): set FLEET_API_URL (or --api) to the scheduler's FLEET_HTTP_ADDR, e.g. http://127.0.0.1:8080"
        )
    } else {
        anyhow::Error::new(e).context(format!("{method} {url}"))
    }
}

/// GETs JSON; `Ok(None)` on 404.
async fn get_json(client: &reqwest::Client, url: &str) -> Result<Option<Value>> {
    let resp = client
        .get(url)
        .send()
        .await
        .map_err(|e| api_send_error(e, "GET", url))?;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    if status == reqwest::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !status.is_success() {
        bail!(
            "GET {url}: {status}: {}",
            body.get("detail").and_then(Value::as_str).unwrap_or("")
        );
    }
    Ok(Some(body))
}

fn api(cli: &Cli, path: &str) -> String {
    format!("{}{path}", cli.api.trim_end_matches('/'))
}

async fn status(cli: &Cli, id: &str, wait: bool, timeout: Duration) -> Result<ExitCode> {
    let client = http()?;
    let url = api(cli, &format!("/v1/tasks/{id}"));
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let found = get_json(&client, &url).await?;
        let terminal = found
            .as_ref()
            .and_then(|v| v.get("state"))
            .and_then(Value::as_str)
            .is_some_and(fleet::status::TaskState::is_terminal_word);
        if !wait || terminal || tokio::time::Instant::now() >= deadline {
            return Ok(match found {
                None => {
                    eprintln!(
                        "fleetctl: task {id} not found (never seen, or older than the status TTL)"
                    );
                    ExitCode::FAILURE
                }
                Some(v) => {
                    out!("{}", serde_json::to_string_pretty(&v)?);
                    if wait && !terminal {
                        eprintln!(
                            "fleetctl: timed out after {} s waiting for task {id} to finish",
                            timeout.as_secs()
                        );
                        ExitCode::FAILURE
                    } else {
                        ExitCode::SUCCESS
                    }
                }
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn workers(cli: &Cli) -> Result<ExitCode> {
    let v = get_json(&http()?, &api(cli, "/v1/workers"))
        .await?
        .unwrap_or(Value::Array(vec![]));
    let workers: Vec<WorkerView> =
        serde_json::from_value(v).context("unexpected /v1/workers answer")?;
    let rows = workers
        .iter()
        .map(|w| {
            vec![
                w.id.clone(),
                w.group.clone(),
                w.state.clone(),
                format!("{}+{}", w.capacity, w.critical_capacity),
                format!("{}+{}", w.running, w.running_critical),
                w.succeeded.to_string(),
                w.retried.to_string(),
                w.dead.to_string(),
                w.expired.to_string(),
                w.unrecorded.to_string(),
                w.kinds.clone(),
                format!("{:.1}s ago", w.last_heartbeat_ms_ago as f64 / 1000.0),
            ]
        })
        .collect();
    // RUNNING is live (the run records a group's LOAD counts too); the outcome columns are
    // user task attempts by outcome (probes excluded), published by each worker as it records
    // them: failed = RETRIED + DEAD, UNRECORDED = the outcome could not be recorded. KINDS: the
    // task kinds it handles (`*`: any), the routing input of issue 29.
    print_table(
        &[
            "ID",
            "GROUP",
            "STATE",
            "CAPACITY(N+C)",
            "RUNNING(N+C)",
            "SUCCEEDED",
            "RETRIED",
            "DEAD",
            "EXPIRED",
            "UNRECORDED",
            "KINDS",
            "LAST HEARTBEAT",
        ],
        rows,
    );
    Ok(ExitCode::SUCCESS)
}

/// The `fleetctl groups` table: the same columns whatever the API has sampled yet (`-` for a
/// figure not there yet). LOAD and RESERVED are live (Redis, at the request); BACKLOG
/// (queued + parked, both lanes) and OLDEST (the oldest task waiting for the group) are the
/// stats loop's sample, as of AS OF (UTC); PROBE is the latest probe through the group.
fn groups_table(groups: &[Value]) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let n = |g: &Value, k: &str| g.get(k).and_then(Value::as_u64).unwrap_or(0);
    let rows = groups
        .iter()
        .map(|g| {
            vec![
                g.get("group")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                n(g, "workers").to_string(),
                n(g, "capacity").to_string(),
                n(g, "load").to_string(),
                n(g, "reserved").to_string(),
                format!("{}/{}", n(g, "critical_capacity"), n(g, "critical_load")),
                g.get("backlog")
                    .and_then(Value::as_u64)
                    .map_or("-".into(), |b| b.to_string()),
                g.get("oldest_task_age_seconds")
                    .and_then(Value::as_f64)
                    .map_or("-".into(), |a| format!("{a:.1}s")),
                g.get("sampled_at")
                    .and_then(Value::as_str)
                    .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
                    .map_or("-".into(), |t| t.format("%H:%M:%S%.3f").to_string()),
                match g.get("probe_ok").and_then(Value::as_bool) {
                    Some(true) => match g.get("probe_seconds").and_then(Value::as_f64) {
                        Some(s) => format!("ok {:.0}ms", s * 1000.0),
                        None => "ok".into(),
                    },
                    Some(false) => format!("FAIL x{}", n(g, "probe_consecutive_failures")),
                    None => "-".into(),
                },
                // Paused lanes and the tasks waiting behind them: `all:600`, `critical:20`.
                match g.get("paused_lanes").and_then(Value::as_array) {
                    Some(l) if l.len() == 2 => format!("all:{}", n(g, "backlog_paused")),
                    Some(l) if !l.is_empty() => format!(
                        "{}:{}",
                        l[0].as_str().unwrap_or("?"),
                        n(g, "backlog_paused")
                    ),
                    _ => "-".into(),
                },
            ]
        })
        .collect();
    let headers = vec![
        "GROUP",
        "WORKERS",
        "CAPACITY",
        "LOAD",
        "RESERVED",
        "CRITICAL CAP/LOAD",
        "BACKLOG",
        "OLDEST",
        "AS OF",
        "PROBE",
        "PAUSED",
    ];
    (headers, rows)
}

async fn groups(cli: &Cli) -> Result<ExitCode> {
    let v = get_json(&http()?, &api(cli, "/v1/groups"))
        .await?
        .unwrap_or(Value::Array(vec![]));
    let groups = v.as_array().cloned().unwrap_or_default();
    let (headers, rows) = groups_table(&groups);
    print_table(&headers, rows);
    // What waits under no group's BACKLOG (`GET /v1/scaling`'s `unrouted`, the same sample
    // the autoscaling API gives): tasks no live worker matches or handles, tasks held by a
    // kind pause, delayed tasks not yet due. A scheduler too old to have the figure: no line.
    if let Ok(Some(sc)) = get_json(&http()?, &api(cli, "/v1/scaling")).await {
        if let Some(line) = unrouted_line(&sc) {
            out!("{line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The line under `fleetctl groups` for the tasks no group holds, from `GET /v1/scaling`:
/// `not in any group: 2 waiting for a worker, 0 held by a kind pause, 0 not yet due (as of
/// 12:00:01.250)`. `None` when the answer has no `unrouted` figures.
fn unrouted_line(scaling: &Value) -> Option<String> {
    let u = scaling.get("unrouted")?;
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let as_of = scaling
        .get("as_of")
        .and_then(Value::as_str)
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .map_or("-".into(), |t| t.format("%H:%M:%S%.3f").to_string());
    Some(format!(
        "not in any group: {} waiting for a worker, {} held by a kind pause, {} not yet due (as of {as_of})",
        n("unmatched"),
        n("paused"),
        n("not_yet_due")
    ))
}

async fn drain(cli: &Cli, id: &str) -> Result<ExitCode> {
    let url = api(cli, &format!("/v1/workers/{id}/drain"));
    let resp = http()?
        .post(&url)
        .json(&serde_json::json!({}))
        .send()
        .await
        .map_err(|e| api_send_error(e, "POST", &url))?;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    if status == reqwest::StatusCode::NOT_FOUND {
        eprintln!("fleetctl: no registered worker with id {id}");
        return Ok(ExitCode::FAILURE);
    }
    if !status.is_success() {
        bail!(
            "POST {url}: {status}: {}",
            body.get("detail").and_then(Value::as_str).unwrap_or("")
        );
    }
    let prev = body
        .get("previous_state")
        .and_then(Value::as_str)
        .unwrap_or("?");
    out!("worker {id}: draining (was {prev})");
    Ok(ExitCode::SUCCESS)
}

async fn cancel(cli: &Cli, id: &str, reason: Option<&str>) -> Result<ExitCode> {
    let url = api(cli, &format!("/v1/tasks/{id}/cancel"));
    let body = match reason {
        Some(r) => serde_json::json!({ "reason": r }),
        None => serde_json::json!({}),
    };
    let resp = http()?
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| api_send_error(e, "POST", &url))?;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    let text = |k: &str| {
        body.get(k)
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string()
    };
    match status {
        reqwest::StatusCode::ACCEPTED => {
            out!("task {id}: cancelled (was {})", text("previous_state"));
            Ok(ExitCode::SUCCESS)
        }
        reqwest::StatusCode::OK => {
            out!("task {id}: already cancelled");
            Ok(ExitCode::SUCCESS)
        }
        reqwest::StatusCode::CONFLICT => {
            eprintln!(
                "fleetctl: task {id} has ended ({}): nothing to cancel",
                text("state")
            );
            Ok(ExitCode::FAILURE)
        }
        reqwest::StatusCode::NOT_FOUND => {
            eprintln!(
                "fleetctl: no status for task {id} (never seen, or older than the status TTL)"
            );
            Ok(ExitCode::FAILURE)
        }
        _ => bail!("POST {url}: {status}: {}", text("detail")),
    }
}

// ---- pause, resume, pauses ----

/// The request body of a pause or resume, and its target in words.
fn pause_body(what: &PauseCmd) -> (Value, String) {
    match what {
        PauseCmd::Group {
            group,
            lane: Some(lane),
            reason,
        } => (
            serde_json::json!({"scope": "lane", "group": group, "lane": lane, "reason": reason}),
            format!("lane {lane} of group {group}"),
        ),
        PauseCmd::Group {
            group,
            lane: None,
            reason,
        } => (
            serde_json::json!({"scope": "group", "group": group, "reason": reason}),
            format!("group {group}"),
        ),
        PauseCmd::Kind { kind, reason } => (
            serde_json::json!({"scope": "kind", "kind": kind, "reason": reason}),
            format!("kind {kind}"),
        ),
        PauseCmd::Key { key, reason } => (
            serde_json::json!({"scope": "key", "key": key, "reason": reason}),
            format!("key {key}"),
        ),
        PauseCmd::Batch { batch, reason } => (
            serde_json::json!({"scope": "batch", "batch": batch, "reason": reason}),
            format!("batch {batch}"),
        ),
    }
}

async fn pause(cli: &Cli, what: &PauseCmd, pausing: bool) -> Result<ExitCode> {
    let path = if pausing {
        "/v1/pauses"
    } else {
        "/v1/pauses/resume"
    };
    let url = api(cli, path);
    let (body, target) = pause_body(what);
    let resp = http()?
        .post(&url)
        .json(&body)
        .send()
        .await
        .map_err(|e| api_send_error(e, "POST", &url))?;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    let detail = body.get("detail").and_then(Value::as_str).unwrap_or("");
    match (status, pausing) {
        (reqwest::StatusCode::ACCEPTED, true) => out!("{target}: paused"),
        (reqwest::StatusCode::OK, true) => out!("{target}: already paused"),
        (reqwest::StatusCode::ACCEPTED, false) => out!("{target}: resumed"),
        (reqwest::StatusCode::OK, false) => out!("{target}: not paused"),
        (reqwest::StatusCode::CONFLICT, _) => {
            eprintln!("fleetctl: {detail}");
            return Ok(ExitCode::FAILURE);
        }
        _ => bail!("POST {url}: {status}: {detail}"),
    }
    Ok(ExitCode::SUCCESS)
}

async fn pauses(cli: &Cli) -> Result<ExitCode> {
    let v = get_json(&http()?, &api(cli, "/v1/pauses"))
        .await?
        .unwrap_or(Value::Null);
    let text = |p: &Value, k: &str| p.get(k).and_then(Value::as_str).unwrap_or("-").to_string();
    let rows = v
        .get("pauses")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|p| {
            let target = match text(p, "scope").as_str() {
                "kind" => text(p, "kind"),
                "key" => text(p, "key"),
                "batch" => text(p, "batch"),
                "lane" => format!("{} {}", text(p, "group"), text(p, "lane")),
                _ => text(p, "group"),
            };
            vec![
                text(p, "scope"),
                target,
                p.get("held")
                    .and_then(Value::as_u64)
                    .map_or("-".into(), |h| h.to_string()),
                text(p, "since"),
                text(p, "by"),
                match text(p, "reason") {
                    r if r.is_empty() => "-".into(),
                    r => r,
                },
            ]
        })
        .collect();
    print_table(&["SCOPE", "TARGET", "HELD", "SINCE", "BY", "REASON"], rows);
    Ok(ExitCode::SUCCESS)
}

// ---- keys, key-limit ----

/// The table of `GET /v1/keys`' rows.
fn keys_table(keys: &[Value]) -> (Vec<&'static str>, Vec<Vec<String>>) {
    let num = |k: &Value, f: &str| match k.get(f) {
        Some(Value::Number(n)) => n.to_string(),
        _ => "-".into(),
    };
    let rows = keys
        .iter()
        .map(|k| {
            vec![
                k.get("key")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                num(k, "running"),
                num(k, "reserved"),
                num(k, "waiting"),
                num(k, "dispatched"),
                num(k, "max_running"),
                num(k, "min_running"),
                num(k, "rate"),
                num(k, "weight"),
                if k.get("paused").and_then(Value::as_bool) == Some(true) {
                    "yes".into()
                } else {
                    "no".into()
                },
            ]
        })
        .collect();
    (
        vec![
            "KEY",
            "RUNNING",
            "RESERVED",
            "WAITING",
            "DISPATCHED",
            "MAX",
            "MIN",
            "RATE",
            "WEIGHT",
            "PAUSED",
        ],
        rows,
    )
}

async fn keys(cli: &Cli) -> Result<ExitCode> {
    let v = get_json(&http()?, &api(cli, "/v1/keys"))
        .await?
        .unwrap_or(Value::Null);
    let keys = v
        .get("keys")
        .and_then(Value::as_array)
        .context("unexpected /v1/keys answer")?;
    let (headers, rows) = keys_table(keys);
    print_table(&headers, rows);
    let default = v
        .get("default")
        .and_then(Value::as_object)
        .map(|d| {
            fleet::control::SPEC_FIELDS
                .iter()
                .filter_map(|f| d.get(*f).map(|v| format!("{f}={v}")))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    out!(
        "{} keys, default spec: {}, as of {}",
        keys.len(),
        if default.is_empty() { "-" } else { &default },
        v.get("as_of").and_then(Value::as_str).unwrap_or("-")
    );
    Ok(ExitCode::SUCCESS)
}

/// `fleetctl batch status <id>`: one line of figures, then the ids waiting for their `after`
/// and the failed ids (at most 50 each).
async fn batch_status(cli: &Cli, id: &str) -> Result<ExitCode> {
    let mut url = reqwest::Url::parse(&api(cli, "/v1/batches")).context("FLEET_API_URL")?;
    url.path_segments_mut()
        .map_err(|()| anyhow!("FLEET_API_URL cannot hold a path"))?
        .push(id);
    let Some(v) = get_json(&http()?, url.as_str()).await? else {
        eprintln!("fleetctl: unknown batch {id}");
        return Ok(ExitCode::FAILURE);
    };
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let list = |k: &str| -> Vec<String> {
        v.get(k)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let fired = list("fired");
    out!(
        "batch {id}: total={} succeeded={} dead={} expired={} cancelled={} pending={} complete={} fired={}",
        n("total"),
        n("succeeded"),
        n("dead"),
        n("expired"),
        n("cancelled"),
        n("pending"),
        v.get("complete").and_then(Value::as_bool).unwrap_or(false),
        if fired.is_empty() { "-".to_string() } else { fired.join(",") }
    );
    for (key, label) in [("waiting", "waiting"), ("failed", "failed")] {
        let ids = list(key);
        if ids.is_empty() {
            continue;
        }
        let shown: Vec<&str> = ids.iter().take(50).map(String::as_str).collect();
        let more = ids.len().saturating_sub(shown.len());
        out!(
            "{label}: {}{}",
            shown.join(" "),
            if more > 0 {
                format!(" (+{more} more)")
            } else {
                String::new()
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `fleetctl batch cancel <id>`: one line with what the cancel did.
async fn batch_cancel(cli: &Cli, id: &str, reason: Option<&str>) -> Result<ExitCode> {
    let mut url = reqwest::Url::parse(&api(cli, "/v1/batches")).context("FLEET_API_URL")?;
    url.path_segments_mut()
        .map_err(|()| anyhow!("FLEET_API_URL cannot hold a path"))?
        .push(id)
        .push("cancel");
    let body = match reason {
        Some(r) => serde_json::json!({ "reason": r }),
        None => serde_json::json!({}),
    };
    let resp = http()?
        .post(url.as_str())
        .json(&body)
        .send()
        .await
        .map_err(|e| api_send_error(e, "POST", url.as_str()))?;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    match status {
        reqwest::StatusCode::ACCEPTED => {
            let already = v.get("already").and_then(Value::as_bool).unwrap_or(false);
            out!(
                "batch {id}: {} (members: cancelled={} already_ended={} failed={} total={})",
                if already {
                    "already cancelled"
                } else {
                    "cancelled"
                },
                n("cancelled"),
                n("already_ended"),
                n("failed"),
                n("total")
            );
            Ok(ExitCode::SUCCESS)
        }
        reqwest::StatusCode::CONFLICT => {
            eprintln!("fleetctl: every member of batch {id} has ended: nothing to cancel");
            Ok(ExitCode::FAILURE)
        }
        reqwest::StatusCode::NOT_FOUND => {
            eprintln!("fleetctl: unknown batch {id}");
            Ok(ExitCode::FAILURE)
        }
        _ => bail!(
            "POST {url}: {status}: {}",
            v.get("detail").and_then(Value::as_str).unwrap_or("?")
        ),
    }
}

/// The URL of `PUT /v1/keys/{key}/limits`, the key percent-encoded (`*`: the default).
fn key_limits_url(cli: &Cli, key: &str) -> Result<reqwest::Url> {
    let mut url = reqwest::Url::parse(&api(cli, "/v1/keys")).context("FLEET_API_URL")?;
    url.path_segments_mut()
        .map_err(|()| anyhow!("FLEET_API_URL cannot hold a path"))?
        .push(key)
        .push("limits");
    Ok(url)
}

/// The body of a key-limit request.
fn key_limit_body(a: &KeyLimitArgs) -> Value {
    let mut body = serde_json::Map::new();
    if !a.clear {
        let fields: [(&str, Option<Value>); 5] = [
            ("max_running", a.max_running.map(Value::from)),
            ("min_running", a.min_running.map(Value::from)),
            ("rate", a.rate.map(Value::from)),
            ("burst", a.burst.map(Value::from)),
            ("weight", a.weight.map(Value::from)),
        ];
        for (k, v) in fields {
            if let Some(v) = v {
                body.insert(k.into(), v);
            }
        }
    }
    if let Some(r) = &a.reason {
        body.insert("reason".into(), Value::from(r.as_str()));
    }
    Value::Object(body)
}

async fn key_limit(cli: &Cli, a: &KeyLimitArgs) -> Result<ExitCode> {
    let key = match (&a.key, a.default) {
        (Some(k), false) => k.as_str(),
        (None, true) => "*",
        _ => bail!("give a KEY or --default, not both"),
    };
    let body = key_limit_body(a);
    if !a.clear
        && body
            .as_object()
            .is_some_and(|b| b.keys().all(|k| k == "reason"))
    {
        bail!("give at least one of --max-running, --min-running, --rate, --burst, --weight, or --clear");
    }
    let url = key_limits_url(cli, key)?;
    let resp = http()?
        .put(url.clone())
        .json(&body)
        .send()
        .await
        .map_err(|e| api_send_error(e, "PUT", url.as_str()))?;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    let detail = v.get("detail").and_then(Value::as_str).unwrap_or("");
    let target = if a.default {
        "the default spec".to_string()
    } else {
        format!("key {key}")
    };
    let what = if a.clear { "cleared" } else { "set" };
    match status {
        reqwest::StatusCode::ACCEPTED => out!("{target}: {what}"),
        reqwest::StatusCode::OK => out!("{target}: already {what}"),
        _ => bail!("PUT {url}: {status}: {detail}"),
    }
    if let Some(l) = v.get("limits").and_then(Value::as_object) {
        let in_force: Vec<String> = fleet::control::SPEC_FIELDS
            .iter()
            .filter_map(|f| {
                l.get(*f)
                    .filter(|v| !v.is_null())
                    .map(|v| format!("{f}={v}"))
            })
            .collect();
        out!(
            "in force: {}",
            if in_force.is_empty() {
                "-".into()
            } else {
                in_force.join(",")
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

// ---- tasks, bulk ----

async fn tasks(cli: &Cli, f: &TaskFilter, limit: u32, cursor: Option<&str>) -> Result<ExitCode> {
    let mut pairs = f.pairs();
    pairs.push(("limit", limit.to_string()));
    if let Some(c) = cursor {
        pairs.push(("cursor", c.to_string()));
    }
    let url = reqwest::Url::parse_with_params(&api(cli, "/v1/tasks"), &pairs)
        .map_err(|e| anyhow!("bad API URL: {e}"))?;
    let v = get_json(&http()?, url.as_str())
        .await?
        .unwrap_or(Value::Null);
    out!("{}", tasks_counts_line(&v));
    let rows: Vec<Vec<String>> = v["tasks"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|t| {
            ["id", "state", "kind", "group", "submitted_at"]
                .iter()
                .map(|k| t[*k].as_str().unwrap_or("").to_string())
                .collect()
        })
        .collect();
    print_table(&["ID", "STATE", "KIND", "GROUP", "SUBMITTED"], rows);
    if let Some(n) = v["next"].as_str() {
        out!("next: {n}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `total=N  queued=.. parked=..` (states with none left out), `(incomplete)` when the walk
/// stopped at its bound.
fn tasks_counts_line(v: &Value) -> String {
    let mut line = format!("total={}", v["total"].as_u64().unwrap_or(0));
    if let Some(m) = v["counts"].as_object() {
        for (s, n) in m {
            if n.as_u64().unwrap_or(0) > 0 {
                line.push_str(&format!(" {s}={n}"));
            }
        }
    }
    if v["complete"] == false {
        line.push_str(" (incomplete: the walk stopped at its bound)");
    }
    line
}

async fn bulk_post(cli: &Cli, body: &Value) -> Result<(reqwest::StatusCode, Value)> {
    let url = api(cli, "/v1/tasks/bulk");
    let resp = http()?
        .post(&url)
        .json(body)
        .send()
        .await
        .map_err(|e| api_send_error(e, "POST", &url))?;
    let status = resp.status();
    Ok((status, resp.json().await.unwrap_or(Value::Null)))
}

async fn bulk(cli: &Cli, action: &str, a: &BulkArgs) -> Result<ExitCode> {
    let mut body = serde_json::json!({"action": action, "limit": a.limit});
    if a.ids.is_empty() {
        body["query"] = a.filter.query();
    } else {
        body["ids"] = serde_json::json!(a.ids);
    }
    if let Some(r) = &a.reason {
        body["reason"] = Value::String(r.clone());
    }
    let fail = |status: reqwest::StatusCode, v: &Value| {
        anyhow!(
            "POST /v1/tasks/bulk: {status}: {}",
            v.get("detail").and_then(Value::as_str).unwrap_or("")
        )
    };
    body["dry_run"] = Value::Bool(true);
    let (status, dry) = bulk_post(cli, &body).await?;
    if !status.is_success() {
        return Err(fail(status, &dry));
    }
    let count = dry["count"].as_u64().unwrap_or(0);
    let sample: Vec<&str> = dry["sample"]
        .as_array()
        .map(|s| s.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    out!("{action}: {count} task(s) selected");
    if !sample.is_empty() {
        out!("sample: {}", sample.join(" "));
    }
    if let Some(m) = dry["ineligible"].as_object().filter(|m| !m.is_empty()) {
        out!("not taken (their state): {}", Value::Object(m.clone()));
    }
    if a.dry_run || count == 0 {
        return Ok(ExitCode::SUCCESS);
    }
    if !a.yes {
        eprintln!(
            "fleetctl: add --yes to {action} these {count} task(s) (or --dry-run to only look)"
        );
        return Ok(ExitCode::FAILURE);
    }
    body["dry_run"] = Value::Bool(false);
    let (status, run) = bulk_post(cli, &body).await?;
    if !status.is_success() {
        return Err(fail(status, &run));
    }
    let n = |k: &str| run[k].as_u64().unwrap_or(0);
    out!(
        "{action}: applied={} skipped={} failed={}",
        n("applied"),
        n("skipped"),
        n("failed")
    );
    for f in run["failures"].as_array().cloned().unwrap_or_default() {
        out!(
            "  failed {}: {}",
            f[0].as_str().unwrap_or("?"),
            f[1].as_str().unwrap_or("?")
        );
    }
    Ok(if n("failed") > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

async fn audit(
    cli: &Cli,
    action: Option<&str>,
    by: Option<&str>,
    since: Option<&str>,
    limit: u32,
) -> Result<ExitCode> {
    let mut url = reqwest::Url::parse(&api(cli, "/v1/audit")).context("FLEET_API_URL")?;
    {
        let mut q = url.query_pairs_mut();
        q.append_pair("limit", &limit.to_string());
        for (k, v) in [("action", action), ("by", by), ("since", since)] {
            if let Some(v) = v {
                q.append_pair(k, v);
            }
        }
    }
    let v = get_json(&http()?, url.as_str())
        .await?
        .unwrap_or(Value::Null);
    let entries = v
        .get("entries")
        .and_then(Value::as_array)
        .context("unexpected /v1/audit answer")?;
    let s = |e: &Value, k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let rows = entries
        .iter()
        .map(|e| {
            let target = e.get("target").map(|t| t.to_string()).unwrap_or_default();
            vec![
                s(e, "at"),
                s(e, "action"),
                s(e, "by"),
                s(e, "role"),
                e.get("count")
                    .and_then(Value::as_u64)
                    .unwrap_or(0)
                    .to_string(),
                one_line(&target, 80),
                one_line(&s(e, "reason"), 40),
            ]
        })
        .collect();
    print_table(
        &["AT", "ACTION", "BY", "ROLE", "COUNT", "TARGET", "REASON"],
        rows,
    );
    let total = v.get("total").and_then(Value::as_u64).unwrap_or(0);
    out!(
        "{} of {total} entries, as of {}",
        entries.len(),
        s(&v, "as_of")
    );
    Ok(ExitCode::SUCCESS)
}

/// Prints rows under headers as an aligned table (comfy-table; no borders, so the output
/// stays easy to read in a terminal and to cut with `awk`). Numeric columns are right-aligned.
fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    out!("{}", table(headers, rows).trim_fmt());
}

fn table(headers: &[&str], rows: Vec<Vec<String>>) -> comfy_table::Table {
    use comfy_table::{presets, CellAlignment, ContentArrangement, Table};
    let numeric: Vec<bool> = (0..headers.len())
        .map(|i| {
            !rows.is_empty()
                && rows.iter().all(|r| {
                    r.get(i)
                        .is_some_and(|c| !c.is_empty() && c.chars().all(|ch| ch.is_ascii_digit()))
                })
        })
        .collect();
    let mut t = Table::new();
    t.load_style(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(headers.to_vec());
    for r in rows {
        t.add_row(r);
    }
    for (i, num) in numeric.iter().enumerate() {
        if let Some(c) = t.column_mut(i) {
            c.set_padding((0, 2));
            c.set_cell_alignment(if *num {
                CellAlignment::Right
            } else {
                CellAlignment::Left
            });
        }
    }
    t
}

// ---- dead letters ----

async fn connect(cli: &Cli) -> Result<Connection> {
    let tls = amqp_tls(cli)?;
    fleet::broker::connect_any(&cli.amqp_url, "fleetctl", &tls)
        .await
        .with_context(|| format!("connecting to {}", fleet::process::redact(&cli.amqp_url)))
}

fn one_line(s: &str, max: usize) -> String {
    let s: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if s.chars().count() > max {
        format!("{}…", s.chars().take(max).collect::<String>())
    } else {
        s
    }
}

async fn dead_list(cli: &Cli, names: &Names, limit: u32) -> Result<ExitCode> {
    let conn = connect(cli).await?;
    // The reader lease keeps this listing from hiding letters from a scheduler's (and the
    // other way round); without Redis the listing goes ahead unleased.
    let store = store(cli, names).ok();
    let listing = dead::list(&conn, store.as_ref(), names, limit)
        .await
        .with_context(|| format!("reading {}", names.dead_queue()));
    let _ = conn.close(200, ShortString::from("done")).await;
    let listing = listing?;
    let rows = listing
        .letters
        .iter()
        .map(|d| {
            vec![
                d.id.clone(),
                d.kind.clone(),
                d.reason.clone(),
                d.attempts.map_or_else(|| "-".into(), |a| a.to_string()),
                d.worker.clone().unwrap_or_else(|| "-".into()),
                one_line(&d.detail, 100),
            ]
        })
        .collect();
    print_table(
        &["ID", "KIND", "REASON", "ATTEMPTS", "WORKER", "DETAIL"],
        rows,
    );
    if listing.depth > limit {
        eprintln!(
            "({limit} of {} dead letters shown; use --limit)",
            listing.depth
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn dead_replay(
    cli: &Cli,
    names: &Names,
    id: Option<&str>,
    all: bool,
    limits: &dead::ReplayLimits,
) -> Result<ExitCode> {
    let conn = connect(cli).await?;
    let store = store(cli, names).ok();
    let sel = match (id, all) {
        (Some(id), false) => dead::Selection::ids([id]),
        _ => dead::Selection::all(),
    };
    let report = dead::replay(&conn, store.as_ref(), names, &sel, limits).await;
    if let Ok(r) = &report {
        let target = serde_json::json!({"ids": id.map(|i| vec![i]), "all": id.is_none()});
        if let Err(e) = audit_direct(&conn, names, "replay", target, r.replayed.len() as u64).await
        {
            eprintln!("fleetctl: the replay is done, but its audit record was not written: {e}");
        }
    }
    let _ = conn.close(200, ShortString::from("done")).await;
    let report = report.with_context(|| format!("replaying from {}", names.dead_queue()))?;
    for (id, why) in &report.failed {
        eprintln!("fleetctl: cannot replay {id}: {why}");
    }
    for id in &report.missing {
        eprintln!("fleetctl: no dead letter with id {id}");
    }
    out!("replayed={}", report.replayed.len());
    Ok(if report.failed.is_empty() && report.missing.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Appends the audit record of an action fleetctl did on the broker directly (not through the
/// API, so with no token): by `fleetctl:<login user>`, role `broker` — whoever holds the
/// broker's credentials ([`fleet::control`]).
async fn audit_direct(
    conn: &Connection,
    names: &Names,
    action: &str,
    target: Value,
    count: u64,
) -> Result<()> {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let who = fleet::settings::Caller {
        name: format!("fleetctl:{user}"),
        role: None,
    };
    let at = chrono::Utc::now().timestamp_millis();
    let mut rec = fleet::control::Record::audit(action, target, count, &who, "", at);
    if let fleet::control::Op::Audit { role, .. } = &mut rec.op {
        *role = "broker".into();
    }
    let publisher = fleet::broker::amqp::confirm_channel(conn).await?;
    fleet::control::append(&publisher, names, &rec).await?;
    Ok(())
}

// ---- schedules ----

#[derive(Subcommand)]
enum ScheduleCmd {
    /// Add a schedule (POST /v1/schedules).
    #[command(
        override_usage = "fleetctl schedule add [OPTIONS] --cron <CRON> --kind <KIND> <NAME>"
    )]
    Add(Box<ScheduleAddArgs>),
    /// List schedules with their next and last ticks.
    List,
    /// Stop firing (ticks while paused are never caught up).
    #[command(override_usage = "fleetctl schedule pause [OPTIONS] <NAME>")]
    Pause { name: String },
    /// Fire again from now on.
    #[command(override_usage = "fleetctl schedule resume [OPTIONS] <NAME>")]
    Resume { name: String },
    /// Delete a schedule.
    #[command(override_usage = "fleetctl schedule rm [OPTIONS] <NAME>")]
    Rm { name: String },
    /// Submit the schedule's task now, through admission; prints the task id.
    #[command(override_usage = "fleetctl schedule fire-now [OPTIONS] <NAME>")]
    FireNow { name: String },
}

#[derive(Args)]
struct ScheduleAddArgs {
    name: String,
    /// `sec min hour day-of-month month day-of-week [year]`; five fields = classic cron.
    #[arg(long)]
    cron: String,
    /// IANA time zone of the cron fields.
    #[arg(long, default_value = "UTC")]
    timezone: String,
    /// Handler name of the task each tick submits.
    #[arg(long)]
    kind: String,
    /// Payload (JSON).
    #[arg(long)]
    payload: Option<String>,
    /// Selector `k=v,k=v`.
    #[arg(long)]
    labels: Option<String>,
    /// The task's lane (default normal).
    #[arg(long, value_enum)]
    lane: Option<LaneArg>,
    /// Executor the task needs (builtin, http, exec).
    #[arg(long)]
    protocol: Option<String>,
    /// The task's deadline, milliseconds after its tick.
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// Runs before the task is dead (default: the scheduler's FLEET_MAX_ATTEMPTS).
    #[arg(long)]
    max_attempts: Option<u32>,
    /// Missed ticks after an outage: `skip` or `catch_up`.
    #[arg(long, default_value = "skip", value_parser = ["skip", "catch_up"])]
    missed: String,
    /// With `--missed catch_up`: at most this many missed ticks are fired.
    #[arg(long, default_value_t = 1)]
    catch_up_max: u32,
    /// Add it paused.
    #[arg(long)]
    paused: bool,
}

/// Sends a schedule request; on an error answer prints the API's reason and returns `None`.
/// A POST always carries a JSON body (`{}` when there is nothing to say): the API takes no
/// other content type.
async fn schedule_call(
    method: reqwest::Method,
    url: &str,
    body: Option<&Value>,
) -> Result<Option<Value>> {
    let mut req = http()?.request(method.clone(), url);
    match body {
        Some(b) => req = req.json(b),
        None if method == reqwest::Method::POST => req = req.json(&serde_json::json!({})),
        None => {}
    }
    let resp = req
        .send()
        .await
        .map_err(|e| api_send_error(e, method.as_str(), url))?;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    if status.is_success() {
        return Ok(Some(v));
    }
    let detail = v.get("detail").and_then(Value::as_str).unwrap_or("");
    eprintln!("fleetctl: {status}: {detail}");
    Ok(None)
}

async fn schedule(cli: &Cli, cmd: &ScheduleCmd) -> Result<ExitCode> {
    use reqwest::Method;
    let done = |r: Option<Value>, f: &dyn Fn(&Value)| match r {
        Some(v) => {
            f(&v);
            ExitCode::SUCCESS
        }
        None => ExitCode::FAILURE,
    };
    Ok(match cmd {
        ScheduleCmd::Add(a) => {
            let mut task = serde_json::Map::new();
            task.insert("kind".into(), a.kind.clone().into());
            if let Some(p) = &a.payload {
                task.insert(
                    "payload".into(),
                    serde_json::from_str(p).context("--payload is not valid JSON")?,
                );
            }
            if let Some(l) = &a.labels {
                let labels = Labels::parse(l).map_err(|e| anyhow!("--labels: {e}"))?;
                task.insert("labels".into(), serde_json::to_value(&labels)?);
            }
            for (k, v) in [
                ("lane", a.lane.map(|l| Value::from(l.lane().as_str()))),
                ("protocol", a.protocol.clone().map(Value::from)),
                ("timeout_ms", a.timeout_ms.map(Value::from)),
                ("max_attempts", a.max_attempts.map(Value::from)),
            ] {
                if let Some(v) = v {
                    task.insert(k.into(), v);
                }
            }
            let body = serde_json::json!({
                "name": a.name, "cron": a.cron, "timezone": a.timezone, "task": task,
                "missed": a.missed, "catch_up_max": a.catch_up_max, "enabled": !a.paused,
            });
            let r = schedule_call(Method::POST, &api(cli, "/v1/schedules"), Some(&body)).await?;
            done(r, &|v| {
                out!(
                    "schedule {}: added, next tick {}",
                    a.name,
                    v.get("next_tick").and_then(Value::as_str).unwrap_or("-")
                )
            })
        }
        ScheduleCmd::List => {
            let r = schedule_call(Method::GET, &api(cli, "/v1/schedules"), None).await?;
            done(r, &|v| {
                let s = |x: &Value, k: &str| {
                    x.get(k).and_then(Value::as_str).unwrap_or("-").to_string()
                };
                let rows = v
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|x| {
                        let state = if x.get("enabled").and_then(Value::as_bool).unwrap_or(true) {
                            "active"
                        } else {
                            "paused"
                        };
                        let kind = x
                            .pointer("/task/kind")
                            .and_then(Value::as_str)
                            .unwrap_or("-")
                            .to_string();
                        vec![
                            s(x, "name"),
                            s(x, "cron"),
                            s(x, "timezone"),
                            kind,
                            state.into(),
                            s(x, "missed"),
                            s(x, "next_tick"),
                            s(x, "last_tick"),
                        ]
                    })
                    .collect();
                print_table(
                    &[
                        "NAME",
                        "CRON",
                        "TIMEZONE",
                        "KIND",
                        "STATE",
                        "MISSED",
                        "NEXT TICK",
                        "LAST TICK",
                    ],
                    rows,
                );
            })
        }
        ScheduleCmd::Pause { name } => {
            let r = schedule_call(
                Method::POST,
                &api(cli, &format!("/v1/schedules/{name}/pause")),
                None,
            )
            .await?;
            done(r, &|_| out!("schedule {name}: paused"))
        }
        ScheduleCmd::Resume { name } => {
            let r = schedule_call(
                Method::POST,
                &api(cli, &format!("/v1/schedules/{name}/resume")),
                None,
            )
            .await?;
            done(r, &|_| out!("schedule {name}: resumed"))
        }
        ScheduleCmd::Rm { name } => {
            let r = schedule_call(
                Method::DELETE,
                &api(cli, &format!("/v1/schedules/{name}")),
                None,
            )
            .await?;
            done(r, &|_| out!("schedule {name}: deleted"))
        }
        ScheduleCmd::FireNow { name } => {
            let r = schedule_call(
                Method::POST,
                &api(cli, &format!("/v1/schedules/{name}/fire")),
                None,
            )
            .await?;
            done(r, &|v| {
                out!("{}", v.get("id").and_then(Value::as_str).unwrap_or(""))
            })
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        let mut argv = vec!["fleetctl"];
        argv.extend_from_slice(args);
        argv.push("workers");
        Cli::parse_from(argv)
    }

    /// With FLEET_REDIS_SENTINELS, fleetctl's Redis URL is the daemons' Sentinel form: the
    /// Sentinels, the master, and the password and db of FLEET_REDIS_URL.
    #[test]
    fn redis_url_is_built_like_the_daemons() {
        let c = cli(&[
            "--redis-url",
            "redis://:s3cret@127.0.0.1:6379/2",
            "--redis-sentinels",
            "10.0.0.1:26379, 10.0.0.2:26379",
            "--redis-master",
            "prod",
        ]);
        let url = redis_url(&c).unwrap();
        assert_eq!(
            url,
            "redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2:26379/prod/2"
        );
        assert_eq!(
            url,
            fleet::redis::Target::from_settings(
                "10.0.0.1:26379, 10.0.0.2:26379",
                "prod",
                "redis://:s3cret@127.0.0.1:6379/2"
            )
        );
        // The default master name, no db.
        let c = cli(&[
            "--redis-url",
            "redis://127.0.0.1:6379",
            "--redis-sentinels",
            "s1:26379",
        ]);
        assert_eq!(redis_url(&c).unwrap(), "redis+sentinel://s1:26379/mymaster");
        // Without Sentinels: FLEET_REDIS_URL as given.
        let c = cli(&["--redis-url", "redis://10.1.1.1:6380/1"]);
        assert_eq!(redis_url(&c).unwrap(), "redis://10.1.1.1:6380/1");
        // The daemons' checks, naming the setting.
        let c = cli(&[
            "--redis-url",
            "rediss://h:6379",
            "--redis-sentinels",
            "s1:26379",
        ]);
        assert!(redis_url(&c)
            .unwrap_err()
            .to_string()
            .contains("FLEET_REDIS_SENTINELS"));
        let c = cli(&[
            "--redis-url",
            "redis://h:6379",
            "--redis-sentinels",
            "s1:26379",
            "--redis-master",
            " ",
        ]);
        assert!(redis_url(&c)
            .unwrap_err()
            .to_string()
            .contains("FLEET_REDIS_MASTER"));
        let c = cli(&[
            "--redis-url",
            "redis://h:6379",
            "--redis-sentinels",
            "nohostport",
        ]);
        assert!(redis_url(&c)
            .unwrap_err()
            .to_string()
            .contains("FLEET_REDIS_SENTINELS"));
    }

    #[test]
    fn shards_default_to_one_and_are_range_checked() {
        assert_eq!(cli(&[]).shards, 1);
        assert_eq!(cli(&["--shards", "4"]).shards, 4);
        assert!(Cli::try_parse_from(["fleetctl", "--shards", "0", "workers"]).is_err());
    }

    fn key_limit_args(args: &[&str]) -> Result<KeyLimitArgs, clap::Error> {
        let mut argv = vec!["fleetctl", "key-limit"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv)?.cmd {
            Cmd::KeyLimit(a) => Ok(a),
            _ => unreachable!("key-limit parses as KeyLimit"),
        }
    }

    #[test]
    fn key_limit_sends_the_fields_given_and_clear_sends_none() {
        let a = key_limit_args(&[
            "acme",
            "--max-running",
            "5",
            "--weight",
            "2.5",
            "--reason",
            "vip",
        ])
        .unwrap();
        assert_eq!(
            key_limit_body(&a),
            serde_json::json!({"max_running": 5, "weight": 2.5, "reason": "vip"})
        );
        let d = key_limit_args(&["--default", "--rate", "3"]).unwrap();
        assert!(d.default && d.key.is_none());
        assert_eq!(key_limit_body(&d), serde_json::json!({"rate": 3.0}));
        let c = key_limit_args(&["acme", "--clear"]).unwrap();
        assert_eq!(key_limit_body(&c), serde_json::json!({}));
        assert!(key_limit_args(&["acme", "--clear", "--max-running", "3"]).is_err());
        assert!(
            key_limit_args(&["--max-running", "3"]).is_err(),
            "a key or --default"
        );
        assert!(key_limit_args(&["acme", "--default", "--rate", "1"]).is_err());
        let url = key_limits_url(&cli(&["--api", "http://h:1/"]), "team/a b").unwrap();
        assert_eq!(url.as_str(), "http://h:1/v1/keys/team%2Fa%20b/limits");
    }
}
