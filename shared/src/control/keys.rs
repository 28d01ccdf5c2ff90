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

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
    /// The bucket's size (tasks); default `max(1, ceil(rate / 10))`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Share of a full group's room relative to other keys (default 1; > 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

impl KeyLimitSpec {
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
            let burst = spec
                .burst
                .unwrap_or_else(|| ((r / 10.0).ceil() as u32).max(1));
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
        assert_eq!(acme.rate, Some((20.0, 2)));
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
}
