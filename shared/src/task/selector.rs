//! Labels and selectors.
//!
//! A worker carries a label set (`gpu=true,zone=a`) plus its executor as the implicit label
//! `protocol=<executor>`. A task carries a selector: every `key=value` in it must be present on
//! the worker, exact match. Workers with the same label set form a *group*; the group's name is
//! the canonical (sorted) rendering of its labels, so the same labels always give the same queues.

use std::collections::BTreeMap;
use std::fmt;

/// The implicit label holding a worker's executor kind.
pub const PROTOCOL_LABEL: &str = "protocol";

/// A set of `key=value` labels, kept sorted so its rendering is canonical.
#[derive(
    Debug,
    Clone,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(transparent)]
pub struct Labels(pub BTreeMap<String, String>);

/// Why a label set or selector was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// An item without `=` (the item).
    #[error("label `{0}` is not of the form key=value")]
    NotPair(String),
    /// A key that is not 1-63 bytes of `[A-Za-z0-9_.-/]` (the key).
    #[error("label key `{0}` is invalid: use 1-63 of [A-Za-z0-9_.-/]")]
    BadKey(String),
    /// A value that is not 1-63 bytes of `[A-Za-z0-9_.-/]` (key, value).
    #[error("label value `{1}` of key `{0}` is invalid: use 1-63 of [A-Za-z0-9_.-/]")]
    BadValue(String, String),
    /// A key given twice (the key).
    #[error("label key `{0}` is given twice")]
    Duplicate(String),
}

fn valid_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/'))
}

impl Labels {
    /// No labels.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses `k=v,k=v` (whitespace around items ignored; empty string = no labels).
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        let mut map = BTreeMap::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| SelectorError::NotPair(item.to_string()))?;
            let (k, v) = (k.trim(), v.trim());
            Self::check(k, v)?;
            if map.insert(k.to_string(), v.to_string()).is_some() {
                return Err(SelectorError::Duplicate(k.to_string()));
            }
        }
        Ok(Labels(map))
    }

    /// Builds from a map, validating every key and value.
    pub fn from_map(map: BTreeMap<String, String>) -> Result<Self, SelectorError> {
        for (k, v) in &map {
            Self::check(k, v)?;
        }
        Ok(Labels(map))
    }

    fn check(k: &str, v: &str) -> Result<(), SelectorError> {
        if !valid_token(k) {
            return Err(SelectorError::BadKey(k.to_string()));
        }
        if !valid_token(v) {
            return Err(SelectorError::BadValue(k.to_string(), v.to_string()));
        }
        Ok(())
    }

    /// These labels with `key=value` added (replacing another value of `key`), unchecked:
    /// for keys and values fleet itself sets ([`PROTOCOL_LABEL`]).
    pub fn with(mut self, key: &str, value: &str) -> Self {
        self.0.insert(key.to_string(), value.to_string());
        self
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Number of `key=value` pairs.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No pairs.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pairs, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter()
    }

    /// True when every pair of `selector` is present in `self` with the same value.
    pub fn satisfies(&self, selector: &Labels) -> bool {
        selector.0.iter().all(|(k, v)| self.0.get(k) == Some(v))
    }

    /// `k=v` strings, sorted: the keys of the Redis label index.
    pub fn pairs(&self) -> Vec<String> {
        self.0.iter().map(|(k, v)| format!("{k}={v}")).collect()
    }

    /// The canonical group name of a worker with these labels: `k=v,k=v` sorted.
    pub fn group_name(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.pairs().join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_match() {
        let worker = Labels::parse("gpu=true, zone=a,protocol=builtin").unwrap();
        assert!(worker.satisfies(&Labels::parse("gpu=true").unwrap()));
        assert!(worker.satisfies(&Labels::parse("").unwrap()));
        assert!(worker.satisfies(&Labels::parse("zone=a,gpu=true").unwrap()));
        assert!(!worker.satisfies(&Labels::parse("gpu=false").unwrap()));
        assert!(!worker.satisfies(&Labels::parse("ssd=true").unwrap()));
        assert_eq!(worker.group_name(), "gpu=true,protocol=builtin,zone=a");
    }

    #[test]
    fn refuses_bad_input() {
        assert_eq!(
            Labels::parse("gpu"),
            Err(SelectorError::NotPair("gpu".into()))
        );
        assert!(matches!(
            Labels::parse("g pu=1"),
            Err(SelectorError::BadKey(_))
        ));
        assert!(matches!(
            Labels::parse("gpu="),
            Err(SelectorError::BadValue(..))
        ));
        assert!(matches!(
            Labels::parse("a=1,a=2"),
            Err(SelectorError::Duplicate(_))
        ));
        assert!(matches!(
            Labels::parse("a=1|x"),
            Err(SelectorError::BadValue(..))
        ));
    }
}
