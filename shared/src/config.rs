//! Settings: every one has an environment variable `FLEET_<NAME>` and a config-file key
//! `<name>` (lower case) in the TOML file named by `FLEET_CONFIG`; the environment wins.
//! A bad value stops start-up with an error naming the setting. Read once, in `main`, and
//! passed down by value.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::selector::Labels;

/// Raw settings: file values overlaid by environment values.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    values: HashMap<String, String>,
}

impl Settings {
    /// Loads `FLEET_CONFIG` (if set) then the `FLEET_*` environment.
    pub fn from_env() -> Result<Self> {
        let mut values = HashMap::new();
        if let Ok(path) = std::env::var("FLEET_CONFIG") {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::config("FLEET_CONFIG", format!("cannot read {path}: {e}")))?;
            values.extend(Self::parse_file(&text)?);
        }
        for (k, v) in std::env::vars() {
            if let Some(name) = k.strip_prefix("FLEET_") {
                if name != "CONFIG" {
                    values.insert(name.to_ascii_lowercase(), v);
                }
            }
        }
        Ok(Settings { values })
    }

    /// Settings from explicit pairs (tests, embedding): keys as in the config file.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, String)>) -> Self {
        Settings { values: pairs.into_iter().map(|(k, v)| (k.to_ascii_lowercase(), v)).collect() }
    }

    pub fn set(&mut self, key: &str, value: impl Into<String>) {
        self.values.insert(key.to_ascii_lowercase(), value.into());
    }

    fn parse_file(text: &str) -> Result<HashMap<String, String>> {
        let table: toml::Table = text.parse().map_err(|e| Error::config("FLEET_CONFIG", format!("invalid TOML: {e}")))?;
        let mut out = HashMap::new();
        for (k, v) in table {
            let s = match v {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                toml::Value::Array(a) => serde_json::to_string(&a).unwrap_or_default(),
                other => return Err(Error::config(k.to_ascii_uppercase(), format!("unsupported value {other}"))),
            };
            out.insert(k.to_ascii_lowercase(), s);
        }
        Ok(out)
    }

    fn raw(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str).filter(|s| !s.trim().is_empty())
    }

    fn name(key: &str) -> String {
        format!("FLEET_{}", key.to_ascii_uppercase())
    }

    pub fn string(&self, key: &str, default: &str) -> String {
        self.raw(key).unwrap_or(default).trim().to_string()
    }

    pub fn opt_string(&self, key: &str) -> Option<String> {
        self.raw(key).map(|s| s.trim().to_string())
    }

    /// A parsed value, or an error naming the setting.
    pub fn parse<T: FromStr>(&self, key: &str, default: T) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        match self.raw(key) {
            None => Ok(default),
            Some(s) => s.trim().parse().map_err(|e| Error::config(Self::name(key), format!("`{s}`: {e}"))),
        }
    }

    /// A number that must be > 0.
    pub fn positive<T>(&self, key: &str, default: T) -> Result<T>
    where
        T: FromStr + PartialOrd + Default + Copy + std::fmt::Display,
        T::Err: std::fmt::Display,
    {
        let v = self.parse(key, default)?;
        if v <= T::default() {
            return Err(Error::config(Self::name(key), format!("must be greater than zero, got {v}")));
        }
        Ok(v)
    }

    /// A fraction in [0, 1].
    pub fn ratio(&self, key: &str, default: f64) -> Result<f64> {
        let v: f64 = self.parse(key, default)?;
        if !(0.0..=1.0).contains(&v) {
            return Err(Error::config(Self::name(key), format!("must be between 0 and 1, got {v}")));
        }
        Ok(v)
    }

    /// Milliseconds, > 0.
    pub fn millis(&self, key: &str, default_ms: u64) -> Result<Duration> {
        Ok(Duration::from_millis(self.positive(key, default_ms)?))
    }

    pub fn labels(&self, key: &str) -> Result<Labels> {
        Labels::parse(self.raw(key).unwrap_or("")).map_err(|e| Error::config(Self::name(key), e.to_string()))
    }

    /// A value out of a fixed set.
    pub fn choice(&self, key: &str, default: &str, allowed: &[&str]) -> Result<String> {
        let v = self.string(key, default);
        if allowed.contains(&v.as_str()) {
            Ok(v)
        } else {
            Err(Error::config(Self::name(key), format!("`{v}` is not one of {}", allowed.join(", "))))
        }
    }

    pub fn error(&self, key: &str, message: impl Into<String>) -> Error {
        Error::config(Self::name(key), message)
    }
}

/// Queue type of the task queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    /// Replicated (Raft) queues: the default, for clusters.
    Quorum,
    /// Classic durable queues: fine on one node, cheaper to create and delete.
    Classic,
}

/// Settings every binary has.
#[derive(Debug, Clone)]
pub struct CommonConfig {
    pub amqp_url: String,
    pub redis_url: String,
    pub namespace: String,
    pub http_addr: String,
    pub log_format: String,
    pub queue_type: QueueType,
    /// Largest envelope accepted, in bytes.
    pub max_task_bytes: usize,
    /// Every dimension of an envelope, checked at the door (`limits.max_bytes` = `max_task_bytes`).
    pub limits: crate::envelope::Limits,
    /// Bound of each ingress queue (normal, critical).
    pub ingress_max_normal: u32,
    pub ingress_max_critical: u32,
    /// Bound of each group's normal-lane park queue.
    pub park_max: u32,
    /// Bound of each group's critical-lane park queue: small, so the critical lane cannot be
    /// used as a second bulk lane — once it is full the critical ingress fills and refuses.
    pub park_max_critical: u32,
    /// How long task status records live in Redis.
    pub status_ttl: Duration,
    pub default_max_attempts: u32,
}

impl CommonConfig {
    pub fn from_settings(s: &Settings, default_http: &str) -> Result<Self> {
        let namespace = s.string("namespace", "fleet");
        if namespace.is_empty()
            || !namespace.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
        {
            return Err(s.error("namespace", format!("`{namespace}`: use letters, digits, _ and -")));
        }
        let queue_type = match s.choice("queue_type", "quorum", &["quorum", "classic"])?.as_str() {
            "classic" => QueueType::Classic,
            _ => QueueType::Quorum,
        };
        let amqp_url = s.string("amqp_url", "amqp://guest:guest@127.0.0.1:5672/%2f");
        if !amqp_url.starts_with("amqp://") && !amqp_url.starts_with("amqps://") {
            return Err(s.error("amqp_url", format!("`{amqp_url}` is not an amqp:// URL")));
        }
        let redis_url = s.string("redis_url", "redis://127.0.0.1:6379");
        if !redis_url.starts_with("redis://") && !redis_url.starts_with("rediss://") {
            return Err(s.error("redis_url", format!("`{redis_url}` is not a redis:// URL")));
        }
        let http_addr = s.string("http_addr", default_http);
        if http_addr.parse::<std::net::SocketAddr>().is_err() {
            return Err(s.error("http_addr", format!("`{http_addr}` is not host:port")));
        }
        let max_task_bytes = s.positive("max_task_bytes", 1usize << 20)?;
        let d = crate::envelope::Limits::default();
        let limits = crate::envelope::Limits {
            max_bytes: max_task_bytes,
            max_label_pairs: s.positive("max_label_pairs", d.max_label_pairs)?,
            max_id_bytes: s.positive("max_id_bytes", d.max_id_bytes)?,
            max_kind_bytes: s.positive("max_kind_bytes", d.max_kind_bytes)?,
            max_payload_depth: s.positive("max_payload_depth", d.max_payload_depth)?,
        };
        Ok(CommonConfig {
            limits,
            amqp_url,
            redis_url,
            namespace,
            http_addr,
            log_format: s.choice("log_format", "text", &["text", "json"])?,
            queue_type,
            max_task_bytes,
            ingress_max_normal: s.positive("ingress_max_normal", 10_000u32)?,
            ingress_max_critical: s.positive("ingress_max_critical", 1_000u32)?,
            park_max: s.positive("park_max", 100_000u32)?,
            park_max_critical: s.positive("park_max_critical", 100u32)?,
            status_ttl: s.millis("status_ttl_ms", 24 * 3600 * 1000)?,
            default_max_attempts: s.positive("max_attempts", 5u32)?,
        })
    }

    pub fn names(&self) -> crate::names::Names {
        crate::names::Names::new(&self.namespace)
    }

    pub fn park_bound(&self, lane: crate::Lane) -> u32 {
        match lane {
            crate::Lane::Normal => self.park_max,
            crate::Lane::Critical => self.park_max_critical,
        }
    }

    pub fn ingress_max(&self, lane: crate::Lane) -> u32 {
        match lane {
            crate::Lane::Normal => self.ingress_max_normal,
            crate::Lane::Critical => self.ingress_max_critical,
        }
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
        let s = Settings::from_pairs([("queue_type", "fancy".to_string())]);
        let e = CommonConfig::from_settings(&s, "127.0.0.1:1").unwrap_err().to_string();
        assert!(e.contains("FLEET_QUEUE_TYPE"), "{e}");
    }

    #[test]
    fn file_then_env() {
        let file = Settings::parse_file("capacity = 8\nlabels = \"gpu=true\"\n").unwrap();
        let s = Settings { values: file };
        assert_eq!(s.positive("capacity", 1u32).unwrap(), 8);
        assert_eq!(s.labels("labels").unwrap().group_name(), "gpu=true");
    }
}
