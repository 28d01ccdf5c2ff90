//! Settings: every one has an environment variable `FLEET_<NAME>` and a config-file key
//! `<name>` (lower case) in the TOML file named by `FLEET_CONFIG`; the environment wins.
//! A bad value stops start-up with an error naming the setting. Read once, in `main`, and
//! passed down by value.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use crate::broker::topology::QueueType;
use crate::error::{Error, Result};
use crate::names::Names;
use crate::task::Labels;

/// Where a raw setting came from (for the warnings about unknown names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// A `FLEET_*` environment variable.
    Environment,
    /// A key of the `FLEET_CONFIG` file.
    File,
    /// Given in code ([`Settings::from_pairs`], [`Settings::set`]).
    Explicit,
}

/// Raw settings: file values overlaid by environment values, plus the command line. The
/// declarations in [`crate::settings`] turn them into typed values.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    values: HashMap<String, String>,
    origins: HashMap<String, Origin>,
    command_line: Vec<std::ffi::OsString>,
}

impl Settings {
    /// Loads `FLEET_CONFIG` (if set) then the `FLEET_*` environment. A missing or malformed
    /// file is an error naming `FLEET_CONFIG`.
    pub fn from_env() -> Result<Self> {
        let mut s = Settings::default();
        if let Ok(path) = std::env::var("FLEET_CONFIG") {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::config("FLEET_CONFIG", format!("cannot read {path}: {e}")))?;
            for (k, v) in Self::parse_file(&text)? {
                s.origins.insert(k.clone(), Origin::File);
                s.values.insert(k, v);
            }
        }
        for (k, v) in std::env::vars() {
            if let Some(name) = k.strip_prefix("FLEET_") {
                if name != "CONFIG" {
                    let key = name.to_ascii_lowercase();
                    s.origins.insert(key.clone(), Origin::Environment);
                    s.values.insert(key, v);
                }
            }
        }
        Ok(s)
    }

    /// Settings from explicit pairs (tests, embedding): keys as in the config file.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, String)>) -> Self {
        let mut s = Settings::default();
        for (k, v) in pairs {
            s.set(k, v);
        }
        s
    }

    /// The process's command line (program name first); its flags win over every other source.
    pub fn with_command_line(mut self, args: Vec<std::ffi::OsString>) -> Self {
        self.command_line = args.into_iter().skip(1).collect();
        self
    }

    /// Sets `key` (config-file spelling, any case) to `value`, over any earlier value; its
    /// origin becomes [`Origin::Explicit`].
    pub fn set(&mut self, key: &str, value: impl Into<String>) {
        let key = key.to_ascii_lowercase();
        self.origins.insert(key.clone(), Origin::Explicit);
        self.values.insert(key, value.into());
    }

    /// Every (key, value), sorted by key.
    pub fn pairs(&self) -> Vec<(&str, &str)> {
        let mut v: Vec<(&str, &str)> = self
            .values
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        v.sort();
        v
    }

    /// Every key with where it came from, sorted by key.
    pub fn origins(&self) -> Vec<(&str, Origin)> {
        let mut v: Vec<(&str, Origin)> =
            self.origins.iter().map(|(k, o)| (k.as_str(), *o)).collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// The command line after the program name.
    pub fn command_line(&self) -> &[std::ffi::OsString] {
        &self.command_line
    }

    /// Settings from the text of a config file (TOML, flat `key = value`), as `FLEET_CONFIG`
    /// names it. Errors name `FLEET_CONFIG` or the bad key.
    pub fn from_toml(text: &str) -> Result<Self> {
        let mut s = Settings::default();
        for (k, v) in Self::parse_file(text)? {
            s.origins.insert(k.clone(), Origin::File);
            s.values.insert(k, v);
        }
        Ok(s)
    }

    fn parse_file(text: &str) -> Result<HashMap<String, String>> {
        let table: toml::Table = text
            .parse()
            .map_err(|e| Error::config("FLEET_CONFIG", format!("invalid TOML: {e}")))?;
        let mut out = HashMap::new();
        for (k, v) in table {
            let s = match v {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                toml::Value::Array(a) => serde_json::to_string(&a).unwrap_or_default(),
                other => {
                    return Err(Error::config(
                        "FLEET_CONFIG",
                        format!("key `{k}`: unsupported value {other}"),
                    ))
                }
            };
            out.insert(k.to_ascii_lowercase(), s);
        }
        Ok(out)
    }

    fn raw(&self, key: &str) -> Option<&str> {
        self.values
            .get(key)
            .map(String::as_str)
            .filter(|s| !s.trim().is_empty())
    }

    fn name(key: &str) -> String {
        format!("FLEET_{}", key.to_ascii_uppercase())
    }

    /// The value of `key`, trimmed; `default` when it is unset or blank.
    pub fn string(&self, key: &str, default: &str) -> String {
        self.raw(key).unwrap_or(default).trim().to_string()
    }

    /// The value of `key`, trimmed; `None` when it is unset or blank.
    pub fn opt_string(&self, key: &str) -> Option<String> {
        self.raw(key).map(|s| s.trim().to_string())
    }

    /// The value of `key` parsed as `T`; `default` when unset or blank.
    ///
    /// # Errors
    /// [`Error::Config`] naming `FLEET_<KEY>` and the bad value when it does not parse.
    pub fn parse<T: FromStr>(&self, key: &str, default: T) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        match self.raw(key) {
            None => Ok(default),
            Some(s) => s
                .trim()
                .parse()
                .map_err(|e| Error::config(Self::name(key), format!("`{s}`: {e}"))),
        }
    }

    /// A number that must be > 0 ([`Settings::parse`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting: it does not parse, or is not above zero.
    pub fn positive<T>(&self, key: &str, default: T) -> Result<T>
    where
        T: FromStr + PartialOrd + Default + Copy + std::fmt::Display,
        T::Err: std::fmt::Display,
    {
        let v = self.parse(key, default)?;
        if v <= T::default() {
            return Err(Error::config(
                Self::name(key),
                format!("must be greater than zero, got {v}"),
            ));
        }
        Ok(v)
    }

    /// A fraction in [0, 1].
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting: it does not parse, or is outside [0, 1].
    pub fn ratio(&self, key: &str, default: f64) -> Result<f64> {
        let v: f64 = self.parse(key, default)?;
        if !(0.0..=1.0).contains(&v) {
            return Err(Error::config(
                Self::name(key),
                format!("must be between 0 and 1, got {v}"),
            ));
        }
        Ok(v)
    }

    /// A duration given in milliseconds, > 0.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting: it does not parse, or is 0.
    pub fn millis(&self, key: &str, default_ms: u64) -> Result<Duration> {
        Ok(Duration::from_millis(self.positive(key, default_ms)?))
    }

    /// A label list (`k=v,k=v`); none when unset.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting and what is wrong with the list.
    pub fn labels(&self, key: &str) -> Result<Labels> {
        Labels::parse(self.raw(key).unwrap_or(""))
            .map_err(|e| Error::config(Self::name(key), e.to_string()))
    }

    /// A value out of a fixed set (`default` when unset).
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting and the allowed values.
    pub fn choice(&self, key: &str, default: &str, allowed: &[&str]) -> Result<String> {
        let v = self.string(key, default);
        if allowed.contains(&v.as_str()) {
            Ok(v)
        } else {
            Err(Error::config(
                Self::name(key),
                format!("`{v}` is not one of {}", allowed.join(", ")),
            ))
        }
    }

    /// An [`Error::Config`] naming `FLEET_<KEY>`, for checks made outside these readers.
    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::config(Self::name(key), message)
    }
}

/// Settings every binary has.
#[derive(Debug, Clone)]
pub struct CommonConfig {
    /// RabbitMQ URL, or several nodes' URLs (`FLEET_AMQP_URL`).
    pub amqp_url: String,
    /// The Redis URL to connect with (see [`redis_url`]).
    pub redis_url: String,
    /// The namespace of every queue and key (`FLEET_NAMESPACE`).
    pub namespace: String,
    /// `host:port` the HTTP API listens on (`FLEET_HTTP_ADDR`).
    pub http_addr: String,
    /// Log format (`FLEET_LOG_FORMAT`): `text` or `json`.
    pub log_format: String,
    /// Type of the task queues (`FLEET_QUEUE_TYPE`).
    pub queue_type: QueueType,
    /// `x-queue-leader-locator` of new quorum queues (`balanced`, `client-local`), or `None`.
    pub leader_locator: Option<String>,
    /// Largest envelope accepted, in bytes.
    pub max_task_bytes: usize,
    /// Every dimension of an envelope, checked at the door (`limits.max_bytes` = `max_task_bytes`).
    pub limits: crate::task::Limits,
    /// Bound of each lane's ingress queue (messages): `FLEET_INGRESS_MAX_NORMAL`,
    /// `FLEET_INGRESS_MAX_CRITICAL`.
    pub ingress_max: crate::PerLane<u32>,
    /// Bound of each group's park queue per lane (messages): `FLEET_PARK_MAX`,
    /// `FLEET_PARK_MAX_CRITICAL`. The critical one is small, so the critical lane cannot be
    /// used as a second bulk lane — once it is full the critical ingress fills and refuses.
    pub park_max: crate::PerLane<u32>,
    /// Fair park queues per group's normal lane for keyed tasks (`FLEET_FAIR_QUEUES`).
    pub fair_queues: u16,
    /// How long task status records live in Redis.
    pub status_ttl: Duration,
    /// Attempts a task gets when its envelope sets no `max_attempts`.
    pub default_max_attempts: u32,
    /// Shard queues per group on the normal lane (`FLEET_SHARDS`, default 1: one queue, as
    /// unsharded) and shards each worker consumes (`FLEET_SHARDS_PER_WORKER`, default 1); see
    /// [`crate::broker`].
    pub subsetting: crate::broker::Subsetting,
    /// TLS client settings for `amqps://` (`FLEET_AMQP_TLS_*`).
    pub amqp_tls: crate::tls::TlsConfig,
    /// TLS client settings for `rediss://` (`FLEET_REDIS_TLS_*`).
    pub redis_tls: crate::tls::TlsConfig,
    /// Who may call the HTTP API (`FLEET_API_TOKENS`, ...).
    pub auth: crate::settings::ApiAuth,
    /// Where task spans are exported (`FLEET_OTLP_ENDPOINT`, an OTLP/HTTP base URL); `None`:
    /// nowhere, no span is made ([`crate::trace`]).
    pub otlp_endpoint: Option<String>,
}

/// The Redis URL a process connects with, from `FLEET_REDIS_URL`, `FLEET_REDIS_SENTINELS` and
/// `FLEET_REDIS_MASTER` (the daemons' and `fleetctl`'s): `redis_url` itself (`redis://`,
/// `rediss://`, `redis+sentinel://` or `redis+cluster://`) when `sentinels` is empty; otherwise the
/// `redis+sentinel://[user:password@]s1:port,s2:port/<master>[/<db>]` form built by
/// [`crate::redis::Target::from_settings`], the credentials and db taken from a `redis://`
/// `redis_url`. Errors ([`Error::Config`]) name the setting: a URL of another scheme, Sentinels
/// given both ways, an empty master name, a Sentinel that is not `host:port`.
pub fn redis_url(redis_url: &str, sentinels: &str, master: &str) -> Result<String> {
    let redis_url = redis_url.trim().to_string();
    let scheme = redis_url
        .split("://")
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    if !redis_url.contains("://")
        || !matches!(
            scheme.as_str(),
            "redis" | "rediss" | "redis+sentinel" | "redis+cluster"
        )
    {
        return Err(Error::config("FLEET_REDIS_URL", format!("`{redis_url}` is not a redis://, rediss://, redis+sentinel:// or redis+cluster:// URL")));
    }
    if sentinels.trim().is_empty() {
        crate::redis::Target::parse(&redis_url).map_err(|e| Error::config("FLEET_REDIS_URL", e))?;
        return Ok(redis_url);
    }
    if scheme != "redis" {
        return Err(Error::config("FLEET_REDIS_SENTINELS", "give the Sentinels either here (with a redis:// FLEET_REDIS_URL for the password and db) or in a redis+sentinel:// FLEET_REDIS_URL, not both"));
    }
    let master = master.trim();
    if master.is_empty() {
        return Err(Error::config(
            "FLEET_REDIS_MASTER",
            "the master name is empty",
        ));
    }
    let url = crate::redis::Target::from_settings(sentinels, master, &redis_url);
    crate::redis::Target::parse(&url).map_err(|e| Error::config("FLEET_REDIS_SENTINELS", e))?;
    Ok(url)
}

impl CommonConfig {
    /// The common settings of `s`, with `http_addr` defaulting to `default_http` (tests and
    /// embedding; the binaries go through their own declarations in [`crate::settings`]).
    pub fn from_settings(s: &Settings, default_http: &str) -> Result<Self> {
        let args = crate::settings::parse::<crate::settings::CommonOnly>(s)?.common;
        Self::from_args(&args, s.string("http_addr", default_http))
    }

    /// Validates the parsed common settings (the checks the declarations cannot express).
    pub fn from_args(a: &crate::settings::CommonArgs, http_addr: String) -> Result<Self> {
        let namespace = a.namespace.trim().to_string();
        if namespace.is_empty()
            || !namespace
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
        {
            return Err(Error::config(
                "FLEET_NAMESPACE",
                format!("`{namespace}`: use letters, digits, _ and -"),
            ));
        }
        let queue_type = if a.queue_type == "classic" {
            QueueType::Classic
        } else {
            QueueType::Quorum
        };
        let amqp_url = a.amqp_url.trim().to_string();
        // One URL or a comma-separated list of cluster nodes (see `endpoints`).
        crate::broker::Endpoints::parse(&amqp_url)
            .map_err(|e| Error::config("FLEET_AMQP_URL", e))?;
        let redis_url = redis_url(&a.redis_url, &a.redis_sentinels, &a.redis_master)?;
        // TLS reaches Redis directly (`rediss://`) only: the Sentinel and Cluster pools speak
        // plain TCP, so TLS files with them are refused rather than ignored.
        let target = crate::redis::Target::parse(&redis_url);
        if matches!(
            target,
            Ok(crate::redis::Target::Sentinel { .. } | crate::redis::Target::Cluster { .. })
        ) {
            let what = if matches!(target, Ok(crate::redis::Target::Cluster { .. })) {
                "a Redis Cluster"
            } else {
                "Redis behind Sentinel"
            };
            let tls_set = [
                ("FLEET_REDIS_TLS_CA_FILE", &a.redis_tls_ca_file),
                ("FLEET_REDIS_TLS_CERT_FILE", &a.redis_tls_cert_file),
                ("FLEET_REDIS_TLS_KEY_FILE", &a.redis_tls_key_file),
            ];
            if let Some((name, _)) = tls_set.iter().find(|(_, v)| v.is_some()) {
                return Err(Error::config(*name, format!("TLS to {what} is not supported by this build: use a rediss:// FLEET_REDIS_URL, or unset the FLEET_REDIS_TLS_* files")));
            }
        }
        if http_addr.parse::<std::net::SocketAddr>().is_err() {
            return Err(Error::config(
                "FLEET_HTTP_ADDR",
                format!("`{http_addr}` is not host:port"),
            ));
        }
        let limits = crate::task::Limits {
            max_bytes: a.max_task_bytes,
            max_label_pairs: a.max_label_pairs,
            max_id_bytes: a.max_id_bytes,
            max_kind_bytes: a.max_kind_bytes,
            max_payload_depth: a.max_payload_depth,
        };
        let auth = crate::settings::ApiAuth::from_args(a, &http_addr)?;
        Ok(CommonConfig {
            limits,
            amqp_tls: crate::tls::TlsConfig::from_files(
                "FLEET_AMQP_TLS",
                a.amqp_tls_ca_file.as_deref(),
                a.amqp_tls_cert_file.as_deref(),
                a.amqp_tls_key_file.as_deref(),
            )?,
            redis_tls: crate::tls::TlsConfig::from_files(
                "FLEET_REDIS_TLS",
                a.redis_tls_ca_file.as_deref(),
                a.redis_tls_cert_file.as_deref(),
                a.redis_tls_key_file.as_deref(),
            )?,
            auth,
            amqp_url,
            redis_url,
            namespace,
            http_addr,
            log_format: a.log_format.clone(),
            otlp_endpoint: a.otlp_endpoint.clone(),
            queue_type,
            leader_locator: (a.queue_leader_locator != "none")
                .then(|| a.queue_leader_locator.clone()),
            max_task_bytes: a.max_task_bytes,
            ingress_max: crate::PerLane {
                normal: a.ingress_max_normal,
                critical: a.ingress_max_critical,
            },
            park_max: crate::PerLane {
                normal: a.park_max,
                critical: a.park_max_critical,
            },
            fair_queues: a.fair_queues,
            status_ttl: Duration::from_millis(a.status_ttl_ms),
            default_max_attempts: a.max_attempts,
            subsetting: subsetting(a.shards, a.shards_per_worker)?,
        })
    }

    /// Shard queues of a group's lane: `FLEET_SHARDS` on the normal lane, one on the critical
    /// lane (small by design, never the hot path).
    pub fn shards(&self, lane: crate::Lane) -> u32 {
        match lane {
            crate::Lane::Normal => self.subsetting.shards(),
            crate::Lane::Critical => 1,
        }
    }

    /// The names of [`CommonConfig::namespace`].
    pub fn names(&self) -> crate::names::Names {
        crate::names::Names::new(&self.namespace)
    }
}

fn subsetting(shards: u32, per_worker: u32) -> Result<crate::broker::Subsetting> {
    use crate::broker::{SubsetError, Subsetting};
    Subsetting::new(shards, per_worker).map_err(|e| match e {
        SubsetError::NoShards => Error::config("FLEET_SHARDS", e.to_string()),
        _ => Error::config("FLEET_SHARDS_PER_WORKER", e.to_string()),
    })
}

impl crate::broker::topology::QueueSettings for CommonConfig {
    fn names(&self) -> Names {
        CommonConfig::names(self)
    }
    fn namespace(&self) -> &str {
        &self.namespace
    }
    fn queue_type(&self) -> QueueType {
        self.queue_type
    }
    fn leader_locator(&self) -> Option<&str> {
        self.leader_locator.as_deref()
    }
    fn ingress_max(&self) -> crate::PerLane<u32> {
        self.ingress_max
    }
    fn park_max(&self) -> crate::PerLane<u32> {
        self.park_max
    }
    fn shards(&self, lane: crate::Lane) -> u32 {
        CommonConfig::shards(self, lane)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_setting() {
        let s = Settings::from_pairs([("capacity", "-3".to_string()), ("ratio", "1.5".into())]);
        let e = s.positive("capacity", 4i64).unwrap_err().to_string();
        assert!(e.contains("FLEET_CAPACITY"), "{e}");
        let e = s.ratio("ratio", 0.5).unwrap_err().to_string();
        assert!(e.contains("FLEET_RATIO"), "{e}");
        for (k, v, name) in [
            ("queue_type", "fancy", "FLEET_QUEUE_TYPE"),
            ("amqp_url", "AMQPX://u:hunter2@h/", "FLEET_AMQP_URL"),
            (
                "amqp_url",
                "amqp://u:hunter2@h1/%2f,,amqp://u:hunter2@h2",
                "FLEET_AMQP_URL",
            ),
            (
                "amqp_url",
                "amqp://u:hunter2@h1/%2f;amqp://u:hunter2@h2",
                "FLEET_AMQP_URL",
            ),
            ("redis_url", "redisx://u:hunter2@h/", "FLEET_REDIS_URL"),
            ("ingress_max_normal", "-1", "FLEET_INGRESS_MAX_NORMAL"),
            ("namespace", "a b", "FLEET_NAMESPACE"),
        ] {
            let s = Settings::from_pairs([(k, v.to_string())]);
            let e = CommonConfig::from_settings(&s, "127.0.0.1:1")
                .unwrap_err()
                .to_string();
            assert!(e.contains(name), "{e}");
            assert!(!e.contains("hunter2"), "{e}");
        }
        // The scheme is case-insensitive.
        let s = Settings::from_pairs([("amqp_url", "AMQP://u:p@127.0.0.1:5672/%2f".to_string())]);
        assert!(CommonConfig::from_settings(&s, "127.0.0.1:1").is_ok());
        let s = Settings::from_pairs([
            ("shards", "12".to_string()),
            ("shards_per_worker", "5".into()),
        ]);
        let e = CommonConfig::from_settings(&s, "127.0.0.1:1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_SHARDS_PER_WORKER") && e.contains("multiple"),
            "{e}"
        );
        let s = Settings::from_pairs([("shards", "0".to_string())]);
        let e = CommonConfig::from_settings(&s, "127.0.0.1:1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("FLEET_SHARDS"), "{e}");
        let s = Settings::from_pairs([
            ("shards", "12".to_string()),
            ("shards_per_worker", "3".into()),
        ]);
        let c = CommonConfig::from_settings(&s, "127.0.0.1:1").unwrap();
        assert_eq!((c.subsetting.shards(), c.subsetting.per_worker()), (12, 3));
        assert_eq!(c.shards(crate::Lane::Critical), 1);
    }

    #[test]
    fn redis_tls_behind_sentinel_is_refused_not_ignored() {
        // A PEM file the settings accept (its blocks are read, not verified, at parse time).
        let ca =
            std::env::temp_dir().join(format!("fleet-config-test-ca-{}.pem", std::process::id()));
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nMIIBdzCCAR2gAwIB\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let s = Settings::from_pairs([
            (
                "redis_url",
                "redis+sentinel://:pw@127.0.0.1:26379/mymaster".to_string(),
            ),
            ("redis_tls_ca_file", ca.display().to_string()),
        ]);
        let e = CommonConfig::from_settings(&s, "127.0.0.1:1")
            .unwrap_err()
            .to_string();
        let _ = std::fs::remove_file(&ca);
        assert!(
            e.contains("FLEET_REDIS_TLS_CA_FILE") && e.contains("Sentinel") && !e.contains("pw@"),
            "{e}"
        );
    }

    #[test]
    fn the_redis_cluster_form() {
        let s = Settings::from_pairs([(
            "redis_url",
            "redis+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001".to_string(),
        )]);
        let c = CommonConfig::from_settings(&s, "127.0.0.1:1").unwrap();
        assert_eq!(
            c.redis_url,
            "redis+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001"
        );
        let ca = std::env::temp_dir().join(format!(
            "fleet-config-test-cluster-ca-{}.pem",
            std::process::id()
        ));
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nMIIBdzCCAR2gAwIB\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let s = Settings::from_pairs([
            (
                "redis_url",
                "redis+cluster://:pw@127.0.0.1:7000".to_string(),
            ),
            ("redis_tls_ca_file", ca.display().to_string()),
        ]);
        let e = CommonConfig::from_settings(&s, "127.0.0.1:1")
            .unwrap_err()
            .to_string();
        let _ = std::fs::remove_file(&ca);
        assert!(
            e.contains("FLEET_REDIS_TLS_CA_FILE")
                && e.contains("Redis Cluster")
                && !e.contains("pw@"),
            "{e}"
        );
        let s = Settings::from_pairs([(
            "redis_url",
            "redis+cluster://:pw@127.0.0.1:7000/3".to_string(),
        )]);
        let e = CommonConfig::from_settings(&s, "127.0.0.1:1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_REDIS_URL") && e.contains("database 0") && !e.contains("pw@"),
            "{e}"
        );
    }

    #[test]
    fn url_errors_hide_the_password() {
        let s = Settings::from_pairs([("amqp_url", "http://u:s3cret@h".to_string())]);
        let e = CommonConfig::from_settings(&s, "127.0.0.1:1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("FLEET_AMQP_URL") && !e.contains("s3cret"), "{e}");
        let s =
            Settings::from_pairs([("redis_url", "rediss://u:s3cret@127.0.0.1:6380".to_string())]);
        assert!(CommonConfig::from_settings(&s, "127.0.0.1:1").is_ok());
    }

    #[test]
    fn file_then_env() {
        let file = Settings::parse_file("capacity = 8\nlabels = \"gpu=true\"\n").unwrap();
        let s = Settings {
            values: file,
            ..Settings::default()
        };
        assert_eq!(s.positive("capacity", 1u32).unwrap(), 8);
        assert_eq!(s.labels("labels").unwrap().group_name(), "gpu=true");
    }
}
