//! The worker's settings, read once from [`Settings`] (environment `FLEET_<NAME>` or config-file
//! key `<name>`) and passed down by value. A bad value is an error that names the setting.
//!
//! ## Long tasks and the broker's consumer timeout
//!
//! RabbitMQ closes a consumer's channel when a delivery stays unacknowledged for longer than
//! its `consumer_timeout` (30 minutes by default), and every other task on that channel then
//! loses its ack too. So every run is capped at `max_task_ms` (default 25 minutes, a margin
//! under the broker's limit): a run still going at the cap is cut and counted as a retryable
//! failure. Tasks that legitimately run longer need *both* a raised `consumer_timeout` on the
//! broker (`rabbitmq.conf`, or the queue argument `x-consumer-timeout`) *and* a raised
//! `FLEET_MAX_TASK_MS`, kept below it.

use std::time::Duration;

use fleet::registry::Kinds;
use fleet::settings::WorkerArgs;
use fleet::settings::{CommonConfig, Settings};
use fleet::task::PROTOCOL_LABEL;
use fleet::{Labels, PerLane};

/// The executor a worker runs tasks with; also its implicit `protocol` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutorKind {
    /// Handlers compiled into the process (`noop`, `echo`, `sleep`, `fail`, `cpu`, and any
    /// registered with [`crate::WorkerBuilder::handler`]).
    Builtin,
    /// POST the envelope to an HTTP endpoint.
    Http,
    /// Run a program with the envelope on its stdin.
    Exec,
}

impl ExecutorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutorKind::Builtin => "builtin",
            ExecutorKind::Http => "http",
            ExecutorKind::Exec => "exec",
        }
    }
}

/// Settings of the `http` executor.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub url: String,
    /// Upper bound of one request; the task's remaining time bounds it further.
    pub timeout: Duration,
    /// CA and client certificate for an `https://` endpoint (`FLEET_HTTP_TLS_*`).
    pub tls: fleet::tls::TlsConfig,
    /// Follow redirects (at most 10)? Off by default (`FLEET_HTTP_FOLLOW_REDIRECTS`): a
    /// redirect would send the task's payload to a host the operator did not name.
    pub follow_redirects: bool,
}

/// Settings of the `exec` executor.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// Program and arguments, run without a shell.
    pub argv: Vec<String>,
    /// Bytes of stdout kept as the result; the rest is read and discarded.
    pub max_output: usize,
    /// Exit code meaning "permanent failure: do not retry".
    pub permanent_exit: i32,
}

/// Outlier ejection thresholds (see [`crate::eject`]).
#[derive(Debug, Clone, Copy)]
pub struct EjectConfig {
    /// Outcomes remembered.
    pub window: usize,
    /// Outcomes needed before the ratio is trusted.
    pub min_samples: usize,
    /// Error ratio above which the worker ejects itself.
    pub error_ratio: f64,
    /// How long an ejection lasts.
    pub cooldown: Duration,
}

/// Everything a worker needs, validated.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub common: CommonConfig,
    pub worker_id: String,
    /// The worker's labels including `protocol=<executor>`.
    pub labels: Labels,
    /// Each lane's concurrency (and prefetch): `FLEET_CAPACITY`, `FLEET_CRITICAL_CAPACITY`.
    pub capacity: PerLane<u32>,
    pub executor: ExecutorKind,
    /// `FLEET_KINDS`: the kinds the http or exec executor's endpoint or program handles
    /// (default `*`, every kind; the builtin executor advertises its handler names and
    /// refuses the setting). What the worker advertises is this plus the kinds of its own
    /// handlers (`noop`, and any an embedding program registered): see
    /// [`crate::executor::Handlers::kinds`].
    pub kinds: Kinds,
    pub heartbeat_interval: Duration,
    /// Liveness window: a registration of the same id seen within it is a live duplicate.
    pub heartbeat_timeout: Duration,
    /// Lease of a running-task record; renewed by every heartbeat.
    pub run_lease: Duration,
    /// How long running tasks may take to finish once draining.
    pub drain_grace: Duration,
    pub retry_base: Duration,
    pub retry_cap: Duration,
    /// Cap of one run (see the module docs).
    pub max_task: Duration,
    /// A cancelled exec run's time between SIGTERM and SIGKILL (`FLEET_CANCEL_GRACE_MS`).
    pub cancel_grace: Duration,
    pub eject: EjectConfig,
    pub http: Option<HttpConfig>,
    pub exec: Option<ExecConfig>,
}

impl WorkerConfig {
    /// Reads and validates every worker setting (see [`fleet::settings::WorkerArgs`]).
    pub fn from_settings(s: &Settings) -> fleet::Result<Self> {
        Self::from_args(fleet::settings::parse::<WorkerArgs>(s)?)
    }

    /// Validates what the declarations cannot check alone (relations between settings).
    pub fn from_args(a: WorkerArgs) -> fleet::Result<Self> {
        fn err(setting: &str, message: impl Into<String>) -> fleet::Error {
            fleet::Error::config(setting, message)
        }
        let common = CommonConfig::from_args(&a.common, a.http_addr.trim().to_string())?;
        let worker_id = match a
            .worker_id
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            Some(id) => {
                if !valid_id(id) {
                    return Err(err(
                        "FLEET_WORKER_ID",
                        format!("`{id}`: use 1-128 of [A-Za-z0-9_.:-]"),
                    ));
                }
                id.to_string()
            }
            None => default_worker_id(),
        };
        let executor = match a.executor.as_str() {
            "http" => ExecutorKind::Http,
            "exec" => ExecutorKind::Exec,
            _ => ExecutorKind::Builtin,
        };
        let labels =
            Labels::parse(a.labels.trim()).map_err(|e| err("FLEET_LABELS", e.to_string()))?;
        if let Some(p) = labels.get(PROTOCOL_LABEL) {
            if p != executor.as_str() {
                return Err(err(
                    "FLEET_LABELS",
                    format!(
                        "label {PROTOCOL_LABEL}={p} contradicts executor {}",
                        executor.as_str()
                    ),
                ));
            }
        }
        let labels = labels.with(PROTOCOL_LABEL, executor.as_str());
        let kinds = match a.kinds.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
            None => Kinds::Any,
            Some(_) if executor == ExecutorKind::Builtin => {
                return Err(err(
                    "FLEET_KINDS",
                    "only for FLEET_EXECUTOR=http or exec: the builtin executor advertises its own handler names",
                ))
            }
            Some(k) => Kinds::parse(k).map_err(|e| err("FLEET_KINDS", e.to_string()))?,
        };
        let ms = Duration::from_millis;

        let heartbeat_interval = ms(a.heartbeat_interval_ms);
        let heartbeat_timeout = ms(a.heartbeat_timeout_ms);
        if heartbeat_timeout <= heartbeat_interval {
            return Err(err(
                "FLEET_HEARTBEAT_TIMEOUT_MS",
                "must be longer than FLEET_HEARTBEAT_INTERVAL_MS",
            ));
        }
        let run_lease = ms(a
            .run_lease_ms
            .unwrap_or(a.heartbeat_interval_ms.saturating_mul(3)));
        if run_lease <= heartbeat_interval {
            return Err(err(
                "FLEET_RUN_LEASE_MS",
                "must be longer than FLEET_HEARTBEAT_INTERVAL_MS",
            ));
        }
        let retry_base = ms(a.retry_base_ms);
        let retry_cap = ms(a.retry_cap_ms);
        if retry_cap < retry_base {
            return Err(err(
                "FLEET_RETRY_CAP_MS",
                "must not be shorter than FLEET_RETRY_BASE_MS",
            ));
        }
        let eject = EjectConfig {
            window: a.eject_window,
            min_samples: a.eject_min_samples,
            error_ratio: a.eject_error_ratio,
            cooldown: ms(a.eject_cooldown_ms),
        };
        if eject.min_samples > eject.window {
            return Err(err(
                "FLEET_EJECT_MIN_SAMPLES",
                "must not exceed FLEET_EJECT_WINDOW",
            ));
        }

        let http = match executor {
            ExecutorKind::Http => {
                let Some(url) = a
                    .http_url
                    .as_deref()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                else {
                    return Err(err("FLEET_HTTP_URL", "required when FLEET_EXECUTOR=http"));
                };
                let scheme = url.split("://").next().unwrap_or("").to_ascii_lowercase();
                if !url.contains("://") || !matches!(scheme.as_str(), "http" | "https") {
                    return Err(err(
                        "FLEET_HTTP_URL",
                        format!("`{url}` is not an http:// or https:// URL"),
                    ));
                }
                Some(HttpConfig {
                    url: url.to_string(),
                    timeout: ms(a.http_timeout_ms),
                    tls: fleet::tls::TlsConfig::from_files(
                        "FLEET_HTTP_TLS",
                        a.http_tls_ca_file.as_deref(),
                        a.http_tls_cert_file.as_deref(),
                        a.http_tls_key_file.as_deref(),
                    )?,
                    follow_redirects: a.http_follow_redirects,
                })
            }
            _ => None,
        };
        let exec = match executor {
            ExecutorKind::Exec => {
                let Some(raw) = a
                    .exec_command
                    .as_deref()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                else {
                    return Err(err(
                        "FLEET_EXEC_COMMAND",
                        "required when FLEET_EXECUTOR=exec",
                    ));
                };
                let argv = parse_argv(raw).map_err(|m| err("FLEET_EXEC_COMMAND", m))?;
                Some(ExecConfig {
                    argv,
                    max_output: a.exec_max_output,
                    permanent_exit: a.exec_permanent_exit,
                })
            }
            _ => None,
        };

        Ok(WorkerConfig {
            common,
            worker_id,
            labels,
            capacity: PerLane {
                normal: a.capacity,
                critical: a.critical_capacity,
            },
            executor,
            kinds,
            heartbeat_interval,
            heartbeat_timeout,
            run_lease,
            drain_grace: ms(a.drain_grace_ms),
            retry_base,
            retry_cap,
            max_task: ms(a.max_task_ms),
            cancel_grace: ms(a.cancel_grace_ms),
            eject,
            http,
            exec,
        })
    }

    /// The worker's group: the canonical name of its full label set.
    pub fn group(&self) -> String {
        self.labels.group_name()
    }
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
}

/// `<hostname>-<6 hex>`: unique per process, recognisable per host.
fn default_worker_id() -> String {
    let host = ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|h| {
            h.trim()
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                        c
                    } else {
                        '-'
                    }
                })
                .take(100)
                .collect::<String>()
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "worker".to_string());
    format!("{host}-{:06x}", rand::random::<u32>() & 0xff_ffff)
}

/// An argv: a JSON array of strings, or whitespace-separated words (no shell quoting).
fn parse_argv(raw: &str) -> Result<Vec<String>, String> {
    let raw = raw.trim();
    let argv: Vec<String> = if raw.starts_with('[') {
        serde_json::from_str(raw).map_err(|e| format!("not a JSON array of strings: {e}"))?
    } else {
        raw.split_whitespace().map(str::to_string).collect()
    };
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err("empty command".into());
    }
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> fleet::Result<WorkerConfig> {
        WorkerConfig::from_settings(&Settings::from_pairs(
            pairs.iter().map(|(k, v)| (*k, v.to_string())),
        ))
    }

    #[test]
    fn defaults() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.capacity.normal, 4);
        assert_eq!(c.capacity.critical, 1);
        assert_eq!(c.executor, ExecutorKind::Builtin);
        assert_eq!(c.group(), "protocol=builtin");
        assert_eq!(c.run_lease, Duration::from_secs(30));
        assert_eq!(c.max_task, Duration::from_secs(25 * 60));
        assert_eq!(c.common.http_addr, "127.0.0.1:9100");
        assert!(valid_id(&c.worker_id), "{}", c.worker_id);
    }

    #[test]
    fn labels_get_the_protocol() {
        let c = cfg(&[
            ("labels", "zone=a,gpu=true"),
            ("executor", "exec"),
            ("exec_command", "cat"),
        ])
        .unwrap();
        assert_eq!(c.group(), "gpu=true,protocol=exec,zone=a");
        let e = cfg(&[("labels", "protocol=http")]).unwrap_err().to_string();
        assert!(e.contains("FLEET_LABELS"), "{e}");
    }

    #[test]
    fn bad_values_name_the_setting() {
        for (pairs, name) in [
            (vec![("capacity", "0")], "FLEET_CAPACITY"),
            (vec![("capacity", "70000")], "FLEET_CAPACITY"),
            (vec![("critical_capacity", "x")], "FLEET_CRITICAL_CAPACITY"),
            (vec![("executor", "python")], "FLEET_EXECUTOR"),
            (vec![("executor", "http")], "FLEET_HTTP_URL"),
            (
                vec![("executor", "http"), ("http_url", "ftp://api.example/run")],
                "FLEET_HTTP_URL",
            ),
            (
                vec![
                    ("executor", "http"),
                    ("http_url", "https://api.example/run"),
                    ("http_tls_ca_file", "/nonexistent.pem"),
                ],
                "FLEET_HTTP_TLS_CA_FILE",
            ),
            (
                vec![("executor", "http"), ("http_url", "ftp://x")],
                "FLEET_HTTP_URL",
            ),
            (vec![("executor", "exec")], "FLEET_EXEC_COMMAND"),
            (
                vec![("executor", "exec"), ("exec_command", "[1]")],
                "FLEET_EXEC_COMMAND",
            ),
            (
                vec![("heartbeat_interval_ms", "40000")],
                "FLEET_HEARTBEAT_TIMEOUT_MS",
            ),
            (vec![("eject_error_ratio", "2")], "FLEET_EJECT_ERROR_RATIO"),
            (vec![("worker_id", "a b")], "FLEET_WORKER_ID"),
            (vec![("max_task_ms", "-1")], "FLEET_MAX_TASK_MS"),
            (vec![("kinds", "resize")], "FLEET_KINDS"),
            (
                vec![
                    ("executor", "exec"),
                    ("exec_command", "cat"),
                    ("kinds", "a,,b"),
                ],
                "FLEET_KINDS",
            ),
            (
                vec![
                    ("executor", "exec"),
                    ("exec_command", "cat"),
                    ("kinds", "*,a"),
                ],
                "FLEET_KINDS",
            ),
        ] {
            let e = cfg(&pairs).unwrap_err().to_string();
            assert!(e.contains(name), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn kinds_default_to_every_kind() {
        let exec = [("executor", "exec"), ("exec_command", "cat")];
        assert_eq!(cfg(&exec).unwrap().kinds, Kinds::Any);
        assert_eq!(cfg(&[]).unwrap().kinds, Kinds::Any);
        let mut pairs = exec.to_vec();
        pairs.push(("kinds", "thumbnail,resize"));
        assert_eq!(cfg(&pairs).unwrap().kinds.wire(), "resize,thumbnail");
    }

    #[test]
    fn exec_command_forms() {
        assert_eq!(
            parse_argv(r#"["sh", "-c", "echo a b"]"#).unwrap(),
            vec!["sh", "-c", "echo a b"]
        );
        assert_eq!(
            parse_argv("  /bin/cat  -u ").unwrap(),
            vec!["/bin/cat", "-u"]
        );
        assert!(parse_argv("[]").is_err());
        assert!(parse_argv("   ").is_err());
    }
}
