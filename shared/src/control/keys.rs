//! Per-key limits (tenants): what each fairness `key` may use of the fleet.
//!
//! A task may carry a fairness key ([`crate::Envelope::key`]: a tenant, a customer, a
//! pipeline). Per key an operator sets — in settings, and at runtime through the control stream
//! (durable, audited) — a [`KeyLimitSpec`]: `max_running` (running + reserved, cluster-wide,
//! exact across scheduler replicas: counted by `reserve.lua` in Redis), `min_running` (a share
//! the key is served first up to, while it has work), a token-bucket `rate` (tasks per second,
//! with a `burst`), and a `weight` (its share of a full group's room under weighted fair
//! dispatch, see `scheduler::park::fair`). A spec names only what it sets; [`KeyLimits::for_key`]
//! merges a key's own spec over the default spec over the built-in defaults (no limit, no
//! guaranteed share, weight 1).
//!
//! # Settings and the control stream
//!
//! The limits in force are the settings' ([`KeyLimits::from_settings`]: `FLEET_KEY_DEFAULT`,
//! `FLEET_KEY_LIMITS`) with the control stream's `key_limit` records over them
//! ([`KeyOverrides`]): per key (and for the default spec) the last record wins and *replaces*
//! the settings' spec of that key; a record that clears ([`Op::KeyLimit`] with no spec) gives
//! the key back to its settings. Like a pause, an override in force is appended again once its
//! record is older than [`super::RENEW_AFTER`], so it never ages out of the stream; a cleared
//! override needs no renewal (its aging out changes nothing).

use std::collections::BTreeMap;
use std::time::Duration;

use deadpool_redis::redis;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{Op, Record, MAX_TEXT};
use crate::error::Result;
use crate::redis::Store;
use crate::settings::Caller;

/// The key of tasks that carry none: they share it (one flow of the fair dispatch). No
/// limit applies to it unless set for this name.
pub const DEFAULT_KEY: &str = "_default";

/// What an operator sets for a key (or for every key: the default). Every field is optional:
/// an absent one falls back to the default spec, then to the built-in value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyLimitSpec {
    /// Most tasks of the key running or reserved at once, across every group and scheduler
    /// replica. `0` holds every task of the key (like a pause).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u32>,
    /// Tasks of the key served before any key already at or above its own `min_running`,
    /// while it has work (a guaranteed share, not a reservation of idle room).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_running: Option<u32>,
    /// Dispatches per second (a token bucket in Redis, on Redis's clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// The bucket's size (tasks); default `max(1, ceil(rate))` (one second of the rate).
    /// A key's first bucket starts with one token, so a burst is only ever what idle time
    /// gathered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Share of a full group's room relative to other keys (default 1; > 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// Specs are validated ([`KeyLimitSpec::validate`]) before they are used or recorded: no NaN,
/// so equality is reflexive (records holding a spec compare as `Eq`).
impl Eq for KeyLimitSpec {}

/// The fields of a spec, in the order they are shown.
pub const SPEC_FIELDS: [&str; 5] = ["max_running", "min_running", "rate", "burst", "weight"];

impl KeyLimitSpec {
    /// Parses the settings form `field=value,field=value` (fields of [`SPEC_FIELDS`]; an empty
    /// text is the empty spec), validated.
    ///
    /// # Errors
    /// A message naming the field: unknown, repeated, not a number, out of range.
    pub fn parse_pairs(text: &str) -> std::result::Result<KeyLimitSpec, String> {
        let mut spec = KeyLimitSpec::default();
        let mut seen = Vec::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((name, value)) = pair.split_once('=') else {
                return Err(format!("expected `field=value`, got `{pair}`"));
            };
            let (name, value) = (name.trim(), value.trim());
            if seen.contains(&name) {
                return Err(format!("{name} is given twice"));
            }
            seen.push(name);
            let count = || {
                value
                    .parse::<u32>()
                    .map_err(|_| format!("{name} must be a whole number ≥ 0, got `{value}`"))
            };
            let number = || {
                value
                    .parse::<f64>()
                    .map_err(|_| format!("{name} must be a number, got `{value}`"))
            };
            match name {
                "max_running" => spec.max_running = Some(count()?),
                "min_running" => spec.min_running = Some(count()?),
                "burst" => spec.burst = Some(count()?),
                "rate" => spec.rate = Some(number()?),
                "weight" => spec.weight = Some(number()?),
                other => {
                    return Err(format!(
                        "unknown field `{other}` (expected one of {})",
                        SPEC_FIELDS.join(", ")
                    ))
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }

    /// Parses the API's JSON form: an object of [`SPEC_FIELDS`] (a `null` member is unset;
    /// `{}` is the empty spec), validated.
    ///
    /// # Errors
    /// A message naming the field: unknown, of the wrong type, out of range.
    pub fn from_json(v: &Value) -> std::result::Result<KeyLimitSpec, String> {
        let Value::Object(m) = v else {
            return Err(
                "the body must be a JSON object of max_running, min_running, rate, burst, weight"
                    .into(),
            );
        };
        let mut spec = KeyLimitSpec::default();
        for (name, value) in m {
            if value.is_null() {
                continue;
            }
            let count = || {
                value
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| {
                        format!("{name} must be a whole number 0-{}, got {value}", u32::MAX)
                    })
            };
            let number = || {
                value
                    .as_f64()
                    .ok_or_else(|| format!("{name} must be a number, got {value}"))
            };
            match name.as_str() {
                "max_running" => spec.max_running = Some(count()?),
                "min_running" => spec.min_running = Some(count()?),
                "burst" => spec.burst = Some(count()?),
                "rate" => spec.rate = Some(number()?),
                "weight" => spec.weight = Some(number()?),
                other => {
                    return Err(format!(
                        "unknown field `{other}` (expected one of {})",
                        SPEC_FIELDS.join(", ")
                    ))
                }
            }
        }
        spec.validate()?;
        Ok(spec)
    }

    /// The settings form of the spec ([`parse_pairs`](Self::parse_pairs) reads it back).
    pub fn to_pairs(&self) -> String {
        let mut out = Vec::new();
        if let Some(v) = self.max_running {
            out.push(format!("max_running={v}"));
        }
        if let Some(v) = self.min_running {
            out.push(format!("min_running={v}"));
        }
        if let Some(v) = self.rate {
            out.push(format!("rate={v}"));
        }
        if let Some(v) = self.burst {
            out.push(format!("burst={v}"));
        }
        if let Some(v) = self.weight {
            out.push(format!("weight={v}"));
        }
        out.join(",")
    }

    /// `self` with every field it leaves unset taken from `under`.
    pub fn over(&self, under: &KeyLimitSpec) -> KeyLimitSpec {
        KeyLimitSpec {
            max_running: self.max_running.or(under.max_running),
            min_running: self.min_running.or(under.min_running),
            rate: self.rate.or(under.rate),
            burst: self.burst.or(under.burst),
            weight: self.weight.or(under.weight),
        }
    }

    /// Whether it sets nothing.
    pub fn is_empty(&self) -> bool {
        *self == KeyLimitSpec::default()
    }

    /// Checks every field's range.
    ///
    /// # Errors
    /// A message naming the field: `rate` not finite or ≤ 0, `weight` not finite or ≤ 0,
    /// `burst` 0, `min_running` above `max_running`.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if let Some(r) = self.rate {
            if !r.is_finite() || r <= 0.0 {
                return Err(format!(
                    "rate must be a number > 0 (tasks per second), got {r}"
                ));
            }
        }
        if let Some(w) = self.weight {
            if !w.is_finite() || w <= 0.0 || w > 1_000_000.0 {
                return Err(format!(
                    "weight must be a number > 0 and ≤ 1000000, got {w}"
                ));
            }
        }
        if self.burst == Some(0) {
            return Err("burst must be at least 1".into());
        }
        if let (Some(min), Some(max)) = (self.min_running, self.max_running) {
            if min > max {
                return Err(format!(
                    "min_running ({min}) must not be above max_running ({max})"
                ));
            }
        }
        Ok(())
    }
}

/// One key's limits in force, merged ([`KeyLimits::for_key`]).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyLimit {
    /// Running + reserved never above this; `None`: no limit.
    pub max_running: Option<u32>,
    /// Served first while below this.
    pub min_running: u32,
    /// Token bucket: (tasks per second, burst); `None`: no rate limit.
    pub rate: Option<(f64, u32)>,
    /// Share of a full group's room (> 0).
    pub weight: f64,
}

impl KeyLimit {
    /// Whether the reservation script must count or limit this key (a max or a rate):
    /// a key with neither costs it nothing beyond the per-key accounting.
    pub fn limited(&self) -> bool {
        self.max_running.is_some() || self.rate.is_some()
    }
}

/// The limits in force: a default spec for every key and specs per key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyLimits {
    /// Applies to every key (each field unless a key's own spec sets it).
    pub default: KeyLimitSpec,
    /// Each key's own spec, merged over `default`.
    pub keys: BTreeMap<String, KeyLimitSpec>,
}

impl KeyLimits {
    /// The limits of `key` in force: its spec over the default over the built-in defaults.
    pub fn for_key(&self, key: &str) -> KeyLimit {
        let spec = match self.keys.get(key) {
            Some(own) => own.over(&self.default),
            None => self.default.clone(),
        };
        let rate = spec.rate.map(|r| {
            let burst = spec.burst.unwrap_or_else(|| (r.ceil() as u32).max(1));
            (r, burst)
        });
        KeyLimit {
            max_running: spec.max_running,
            min_running: spec.min_running.unwrap_or(0),
            rate,
            weight: spec.weight.filter(|w| *w > 0.0).unwrap_or(1.0),
        }
    }

    /// Whether nothing is set (every key unlimited, weight 1).
    pub fn is_empty(&self) -> bool {
        self.default.is_empty() && self.keys.values().all(KeyLimitSpec::is_empty)
    }

    /// The limits the settings give: `default` in the form `field=value,...`
    /// (`FLEET_KEY_DEFAULT`, e.g. `max_running=10,rate=20,weight=1`) and `keys` as entries
    /// `KEY:field=value,...` separated by `;` or newlines (`FLEET_KEY_LIMITS`, e.g.
    /// `acme:max_running=5,weight=3;beta:min_running=2`). A key may hold `:` itself: the key
    /// ends at the last `:` before the first `=`.
    ///
    /// # Errors
    /// `(setting, message)`: the setting's variable name and what is wrong (the entry's key
    /// and the field).
    pub fn from_settings(
        default: &str,
        keys: &str,
    ) -> std::result::Result<KeyLimits, (&'static str, String)> {
        let default = KeyLimitSpec::parse_pairs(default).map_err(|e| ("FLEET_KEY_DEFAULT", e))?;
        let mut out = KeyLimits {
            default,
            keys: BTreeMap::new(),
        };
        let bad = |e: String| ("FLEET_KEY_LIMITS", e);
        for entry in keys
            .split(['\n', ';'])
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let head = entry.split('=').next().unwrap_or(entry);
            let Some(colon) = head.rfind(':') else {
                return Err(bad(format!(
                    "expected `KEY:field=value,...`, got `{entry}`"
                )));
            };
            let (key, pairs) = (&entry[..colon], &entry[colon + 1..]);
            crate::task::check_key(key).map_err(|e| bad(format!("key `{key}`: {e}")))?;
            let spec =
                KeyLimitSpec::parse_pairs(pairs).map_err(|e| bad(format!("key `{key}`: {e}")))?;
            if out.keys.insert(key.to_string(), spec).is_some() {
                return Err(bad(format!("key `{key}` is given twice")));
            }
        }
        Ok(out)
    }
}

/// An operator's runtime spec in force: the latest `key_limit` record of a key (or of the
/// default spec) that set one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyOverride {
    /// The key; `None`: the default spec.
    pub key: Option<String>,
    /// The spec in force for it (replacing the settings' spec).
    pub spec: KeyLimitSpec,
    /// When it was first set so (Unix ms): a renewal keeps it.
    pub since_ms: i64,
    /// When its latest record was accepted (Unix ms).
    pub record_ms: i64,
    /// Who set it.
    pub by: String,
    /// The token's role.
    pub role: String,
    /// Why.
    pub reason: String,
}

/// The fold of the control stream's `key_limit` records ([`KeyOverrides::apply`]), in stream
/// order: per key the last record wins.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyOverrides {
    /// By key (`None`: the default spec); a cleared key is absent.
    set: BTreeMap<Option<String>, KeyOverride>,
}

impl KeyOverrides {
    /// Applies `rec` (other records change nothing); `true` when an override changed.
    pub fn apply(&mut self, rec: &Record) -> bool {
        let Op::KeyLimit {
            key,
            spec,
            by,
            role,
            reason,
            since_ms,
        } = &rec.op
        else {
            return false;
        };
        match spec {
            None => self.set.remove(key).is_some(),
            Some(spec) => match self.set.get_mut(key) {
                Some(o) if o.spec == *spec => {
                    o.record_ms = o.record_ms.max(rec.at_ms);
                    false
                }
                _ => {
                    self.set.insert(
                        key.clone(),
                        KeyOverride {
                            key: key.clone(),
                            spec: spec.clone(),
                            since_ms: since_ms.unwrap_or(rec.at_ms),
                            record_ms: rec.at_ms,
                            by: by.clone(),
                            role: role.clone(),
                            reason: reason.clone(),
                        },
                    );
                    true
                }
            },
        }
    }

    /// The limits in force: `settings` with every override replacing its key's spec (the
    /// default's override replacing the default spec).
    pub fn over(&self, settings: &KeyLimits) -> KeyLimits {
        let mut out = settings.clone();
        for (key, o) in &self.set {
            match key {
                None => out.default = o.spec.clone(),
                Some(k) => {
                    out.keys.insert(k.clone(), o.spec.clone());
                }
            }
        }
        out
    }

    /// The override of `key` (`None`: of the default spec), if one is in force.
    pub fn get(&self, key: Option<&str>) -> Option<&KeyOverride> {
        self.set.get(&key.map(str::to_string))
    }

    /// Every override in force.
    pub fn all(&self) -> impl Iterator<Item = &KeyOverride> {
        self.set.values()
    }

    /// Overrides whose latest record is older than `after` at `now_ms`: to be appended again
    /// before the stream's retention drops them.
    pub fn due_for_renewal(&self, now_ms: i64, after: Duration) -> Vec<KeyOverride> {
        let limit = now_ms - after.as_millis() as i64;
        self.set
            .values()
            .filter(|o| o.record_ms < limit)
            .cloned()
            .collect()
    }
}

impl Record {
    /// A `key_limit` record: `who` sets `spec` for `key` (`None`: the default spec; a `None`
    /// or empty spec clears the override) for `reason` at `at_ms`.
    pub fn key_limit(
        key: Option<&str>,
        spec: Option<KeyLimitSpec>,
        who: &Caller,
        reason: &str,
        at_ms: i64,
    ) -> Self {
        Record {
            id: super::new_id(),
            at_ms,
            op: Op::KeyLimit {
                key: key.map(str::to_string),
                spec: spec.filter(|s| !s.is_empty()),
                by: crate::status::truncate(&who.name, MAX_TEXT),
                role: who.role_str().to_string(),
                reason: crate::status::truncate(reason, MAX_TEXT),
                since_ms: None,
            },
        }
    }

    /// The record of `o` appended again at `at_ms` (its renewal: same spec, who, why, since).
    pub fn key_limit_renewal(o: &KeyOverride, at_ms: i64) -> Self {
        Record {
            id: super::new_id(),
            at_ms,
            op: Op::KeyLimit {
                key: o.key.clone(),
                spec: Some(o.spec.clone()),
                by: o.by.clone(),
                role: o.role.clone(),
                reason: o.reason.clone(),
                since_ms: Some(o.since_ms),
            },
        }
    }
}

/// One key's figures in Redis ([`Store::key_figures`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct KeyFigures {
    /// Tasks running now (run leases not lapsed).
    pub running: u64,
    /// Tasks reserved now, dispatched and not started (leases not lapsed).
    pub reserved: u64,
    /// Tasks parked waiting for room now.
    pub waiting: u64,
    /// Tasks dispatched in all (since Redis last lost it, or the key was last forgotten:
    /// idle for `FLEET_KEY_FORGET_MS`).
    pub dispatched: u64,
    /// Last activity (Redis ms); 0: none recorded.
    pub last_ms: i64,
}

impl Store {
    /// Running + reserved of each of `keys` as of `now_ms` (Redis ms: lapsed leases are not
    /// counted), in order: one pipeline of two `ZCOUNT`s per key.
    ///
    /// # Errors
    /// Redis failed.
    pub async fn key_used(&self, keys: &[&str], now_ms: i64) -> Result<Vec<u32>> {
        if keys.is_empty() {
            return Ok(vec![]);
        }
        let mut p = redis::pipe();
        for k in keys {
            p.cmd("ZCOUNT")
                .arg(self.names.key_running(k))
                .arg(now_ms)
                .arg("+inf");
            p.cmd("ZCOUNT")
                .arg(self.names.key_reserved(k))
                .arg(now_ms)
                .arg("+inf");
        }
        let counts: Vec<u64> = self.pipe(&p).await?;
        Ok(counts
            .chunks(2)
            .map(|c| u32::try_from(c.iter().sum::<u64>()).unwrap_or(u32::MAX))
            .collect())
    }

    /// The stored token bucket (tokens, Redis ms of the last take) of each of `keys`, in
    /// order (`None`: no bucket yet): one pipeline of `HMGET`s.
    ///
    /// # Errors
    /// Redis failed.
    pub async fn key_buckets(&self, keys: &[&str]) -> Result<Vec<Option<(f64, i64)>>> {
        if keys.is_empty() {
            return Ok(vec![]);
        }
        let mut p = redis::pipe();
        for k in keys {
            p.cmd("HMGET")
                .arg(self.names.key_bucket(k))
                .arg("tokens")
                .arg("ts");
        }
        let got: Vec<(Option<f64>, Option<i64>)> = self.pipe(&p).await?;
        Ok(got.into_iter().map(|(t, ts)| t.zip(ts)).collect())
    }

    /// The figures of one key as of `now_ms` (Redis ms): one pipeline (`HMGET` of its three
    /// fields, two `ZCOUNT`s).
    ///
    /// # Errors
    /// Redis failed.
    pub async fn key_figure(&self, key: &str, now_ms: i64) -> Result<KeyFigures> {
        let mut p = redis::pipe();
        p.cmd("HMGET")
            .arg(self.names.key_figures())
            .arg(format!("d:{key}"))
            .arg(format!("w:{key}"))
            .arg(format!("t:{key}"));
        p.cmd("ZCOUNT")
            .arg(self.names.key_running(key))
            .arg(now_ms)
            .arg("+inf");
        p.cmd("ZCOUNT")
            .arg(self.names.key_reserved(key))
            .arg(now_ms)
            .arg("+inf");
        let (fields, running, reserved): ([Option<i64>; 3], u64, u64) = self.pipe(&p).await?;
        let [d, w, t] = fields;
        Ok(KeyFigures {
            running,
            reserved,
            waiting: w.unwrap_or(0).max(0) as u64,
            dispatched: d.unwrap_or(0).max(0) as u64,
            last_ms: t.unwrap_or(0),
        })
    }

    /// The figures of every key Redis knows (a `t:` field in the `kf` hash) and of `also`, by
    /// key, as of `now_ms` (Redis ms: leases lapsed before it are not counted). Two round
    /// trips: the hash with the keys that may hold a live lease (the `ka` sorted set scored at
    /// or above `now_ms`), then two `ZCOUNT`s per such key in one pipeline — a key `ka` scores
    /// below `now_ms` holds no live lease (every lease's expiry is also written there, `ZADD
    /// GT`), so its running and reserved are 0 without a command. The cost is the active
    /// keys', not every key ever seen ([`Store::forget_idle_keys`] trims the hash).
    ///
    /// # Errors
    /// Redis failed.
    pub async fn key_figures(
        &self,
        also: impl IntoIterator<Item = String>,
        now_ms: i64,
    ) -> Result<BTreeMap<String, KeyFigures>> {
        let mut p = redis::pipe();
        p.cmd("HGETALL").arg(self.names.key_figures());
        p.cmd("ZRANGE")
            .arg(self.names.key_active())
            .arg(now_ms)
            .arg("+inf")
            .arg("BYSCORE");
        let (hash, live): (Vec<(String, String)>, Vec<String>) = self.pipe(&p).await?;
        let mut out: BTreeMap<String, KeyFigures> = BTreeMap::new();
        for k in also {
            out.entry(k).or_default();
        }
        for (field, value) in &hash {
            if let Some(k) = field.strip_prefix("t:") {
                out.entry(k.to_string()).or_default().last_ms = value.parse().unwrap_or(0);
            }
        }
        for (field, value) in &hash {
            let Some((kind, k)) = field.split_once(':') else {
                continue;
            };
            let Some(f) = out.get_mut(k) else { continue };
            let n = value.parse::<i64>().unwrap_or(0).max(0) as u64;
            match kind {
                "d" => f.dispatched = n,
                "w" => f.waiting = n,
                _ => {}
            }
        }
        // A key with a live lease and no figures (Redis lost the hash, not the sets) is shown.
        for k in &live {
            out.entry(k.clone()).or_default();
        }
        if live.is_empty() {
            return Ok(out);
        }
        let mut p = redis::pipe();
        for k in &live {
            p.cmd("ZCOUNT")
                .arg(self.names.key_running(k))
                .arg(now_ms)
                .arg("+inf");
            p.cmd("ZCOUNT")
                .arg(self.names.key_reserved(k))
                .arg(now_ms)
                .arg("+inf");
        }
        let counts: Vec<u64> = self.pipe(&p).await?;
        for (k, c) in live.iter().zip(counts.chunks(2)) {
            if let Some(f) = out.get_mut(k) {
                f.running = c.first().copied().unwrap_or(0);
                f.reserved = c.get(1).copied().unwrap_or(0);
            }
        }
        Ok(out)
    }

    /// Forgets the keys of `figures` (as [`Store::key_figures`] read them) that went idle: not
    /// routed since `idle_since_ms` (Redis ms), nothing parked waiting, no live lease. Their
    /// figures (`d:`, `w:`, `t:` in the `kf` hash) and lapsed leases go, and the `ka` set drops
    /// every key without a live lease (`control/forget_keys.lua`, which checks each key again
    /// atomically: one dispatched to meanwhile stays). At most `max` keys per call, the
    /// longest idle first. Returns (keys forgotten, lapsed leases dropped with them).
    ///
    /// # Errors
    /// Redis failed.
    pub async fn forget_idle_keys(
        &self,
        figures: &BTreeMap<String, KeyFigures>,
        idle_since_ms: i64,
        max: usize,
    ) -> Result<(u64, u64)> {
        let mut idle: Vec<(&i64, &String)> = figures
            .iter()
            .filter(|(_, f)| {
                f.last_ms > 0
                    && f.last_ms < idle_since_ms
                    && f.waiting == 0
                    && f.running == 0
                    && f.reserved == 0
            })
            .map(|(k, f)| (&f.last_ms, k))
            .collect();
        idle.sort_unstable();
        let mut inv = self.scripts.forget_keys.prepare_invoke();
        inv.key(self.names.prefix()).arg(idle_since_ms);
        for (_, k) in idle.into_iter().take(max) {
            inv.arg(k);
        }
        let r: Vec<u64> = self.invoke(&inv).await?;
        Ok((
            r.first().copied().unwrap_or(0),
            r.get(1).copied().unwrap_or(0),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_spec_merges_over_the_default() {
        let mut l = KeyLimits {
            default: KeyLimitSpec {
                max_running: Some(10),
                rate: Some(20.0),
                ..Default::default()
            },
            ..Default::default()
        };
        l.keys.insert(
            "acme".into(),
            KeyLimitSpec {
                max_running: Some(5),
                weight: Some(3.0),
                ..Default::default()
            },
        );
        let acme = l.for_key("acme");
        assert_eq!(acme.max_running, Some(5));
        assert_eq!(acme.rate, Some((20.0, 20)));
        assert_eq!(acme.weight, 3.0);
        let other = l.for_key("beta");
        assert_eq!(
            (other.max_running, other.min_running, other.weight),
            (Some(10), 0, 1.0)
        );
        assert!(
            KeyLimits::default().for_key("x")
                == KeyLimit {
                    max_running: None,
                    min_running: 0,
                    rate: None,
                    weight: 1.0
                }
        );
    }

    #[test]
    fn validation_names_the_field() {
        let bad = |s: KeyLimitSpec| s.validate().unwrap_err();
        assert!(bad(KeyLimitSpec {
            rate: Some(0.0),
            ..Default::default()
        })
        .contains("rate"));
        assert!(bad(KeyLimitSpec {
            weight: Some(-1.0),
            ..Default::default()
        })
        .contains("weight"));
        assert!(bad(KeyLimitSpec {
            burst: Some(0),
            ..Default::default()
        })
        .contains("burst"));
        assert!(bad(KeyLimitSpec {
            min_running: Some(3),
            max_running: Some(2),
            ..Default::default()
        })
        .contains("min_running"));
    }

    #[test]
    fn settings_parse_and_errors_name_the_setting_and_field() {
        let l = KeyLimits::from_settings(
            "max_running=10,rate=20,weight=1",
            "acme:max_running=5,weight=3; beta:min_running=2\nteam:x@y/z:burst=4",
        )
        .unwrap();
        assert_eq!(
            l.default,
            KeyLimitSpec {
                max_running: Some(10),
                rate: Some(20.0),
                weight: Some(1.0),
                ..Default::default()
            }
        );
        assert_eq!(l.keys.len(), 3);
        assert_eq!(l.keys["acme"].to_pairs(), "max_running=5,weight=3");
        assert_eq!(l.keys["beta"].min_running, Some(2));
        assert_eq!(l.keys["team:x@y/z"].burst, Some(4), "a key holding `:`");
        assert_eq!(
            KeyLimits::from_settings("", "").unwrap(),
            KeyLimits::default()
        );
        for (d, k, setting, word) in [
            ("max_running=x", "", "FLEET_KEY_DEFAULT", "max_running"),
            ("speed=3", "", "FLEET_KEY_DEFAULT", "speed"),
            ("rate=0", "", "FLEET_KEY_DEFAULT", "rate"),
            ("", "acme:weight=-1", "FLEET_KEY_LIMITS", "weight"),
            ("", "acme", "FLEET_KEY_LIMITS", "acme"),
            ("", "bad key!:max_running=1", "FLEET_KEY_LIMITS", "bad key!"),
            ("", "a:burst=1;a:burst=2", "FLEET_KEY_LIMITS", "twice"),
            (
                "",
                "a:min_running=3,max_running=2",
                "FLEET_KEY_LIMITS",
                "min_running",
            ),
        ] {
            let (name, msg) = KeyLimits::from_settings(d, k).unwrap_err();
            assert_eq!(name, setting, "{d} {k}");
            assert!(msg.contains(word), "{msg}");
        }
    }

    #[test]
    fn the_json_form_names_the_field() {
        let j = |t: &str| KeyLimitSpec::from_json(&serde_json::from_str(t).unwrap());
        assert_eq!(j("{}").unwrap(), KeyLimitSpec::default());
        assert_eq!(
            j(r#"{"max_running":5,"rate":2.5,"weight":null}"#).unwrap(),
            KeyLimitSpec {
                max_running: Some(5),
                rate: Some(2.5),
                ..Default::default()
            }
        );
        assert!(j(r#"{"max_running":-1}"#)
            .unwrap_err()
            .contains("max_running"));
        assert!(j(r#"{"rate":"fast"}"#).unwrap_err().contains("rate"));
        assert!(j(r#"{"colour":1}"#).unwrap_err().contains("colour"));
        assert!(j(r#"{"burst":0}"#).unwrap_err().contains("burst"));
        assert!(j("[]").is_err());
    }

    #[test]
    fn stream_records_replace_the_settings_spec_last_one_wins() {
        let who = Caller::anonymous();
        let settings = KeyLimits::from_settings("max_running=10", "acme:max_running=5").unwrap();
        let mut o = KeyOverrides::default();
        let spec = |s: &str| Some(KeyLimitSpec::parse_pairs(s).unwrap());
        assert!(o.apply(&Record::key_limit(
            Some("acme"),
            spec("weight=3"),
            &who,
            "vip",
            10
        )));
        assert!(o.apply(&Record::key_limit(
            None,
            spec("max_running=20"),
            &who,
            "",
            11
        )));
        assert!(o.apply(&Record::key_limit(
            Some("beta"),
            spec("rate=1"),
            &who,
            "",
            12
        )));
        assert!(!o.apply(&Record::barrier("r", 13)));
        let l = o.over(&settings);
        assert_eq!(l.default.max_running, Some(20));
        // The record replaces acme's settings spec: its max comes from the default now.
        assert_eq!(l.for_key("acme").max_running, Some(20));
        assert_eq!(l.for_key("acme").weight, 3.0);
        assert_eq!(l.for_key("beta").rate, Some((1.0, 1)));
        // Cleared: acme has its settings spec again.
        assert!(o.apply(&Record::key_limit(Some("acme"), None, &who, "", 14)));
        assert!(!o.apply(&Record::key_limit(Some("acme"), spec(""), &who, "", 15)));
        assert_eq!(o.over(&settings).for_key("acme").max_running, Some(5));
        // Renewal keeps since and is no audit entry.
        let day = 86_400_000i64;
        let due = o.due_for_renewal(4 * day, super::super::RENEW_AFTER);
        assert_eq!(due.len(), 2);
        let r = Record::key_limit_renewal(&due[0], 4 * day);
        assert!(super::super::AuditEntry::of(&r).is_none());
        let mut fresh = KeyOverrides::default();
        fresh.apply(&r);
        assert_eq!(fresh.all().next().unwrap().since_ms, due[0].since_ms);
        let rec = Record::key_limit(Some("acme"), spec("max_running=2"), &who, "why", 5);
        let e = super::super::AuditEntry::of(&rec).unwrap();
        assert_eq!(e.action, "key_limit");
        assert_eq!(
            e.target,
            serde_json::json!({"key": "acme", "spec": {"max_running": 2}})
        );
        let v = serde_json::to_value(&rec).unwrap();
        assert_eq!(v["op"], "key_limit");
        assert_eq!(serde_json::from_value::<Record>(v).unwrap(), rec);
    }
}
