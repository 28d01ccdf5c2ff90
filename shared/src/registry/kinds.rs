//! Kinds: which task kinds a worker handles, the routing input beside labels.
//!
//! A worker advertises its kinds in its registration (worker hash field `kinds`): the builtin
//! executor its handler names, the `exec` and `http` executors what `FLEET_KINDS` declares
//! (`*`, every kind, by default). A group handles kind K when **every active worker of the
//! group** handles K — the intersection, kept in the group hash's `kinds` field by the registry
//! scripts (`worker.lua` `refresh_kinds`) whenever an active worker with a kind list joins,
//! leaves or changes state. The intersection is what makes a rolling deploy safe: a new kind is
//! routed to a group only once all of its consumers have it, since a task in the group queue
//! may reach any of them. The reservation script reads the field in the same `HMGET` that reads
//! the group's capacity, so routing by kind costs no Redis command per task.
//!
//! Wire form: `*`, or the kinds joined by `,` in sorted order (`noop,resize`); a missing
//! field (a registration written before kinds existed) reads as `*`.

use std::collections::BTreeSet;
use std::fmt;

/// Longest kind a worker may declare, in bytes: the envelope's own `max_kind_bytes` default
/// (a longer kind could never be submitted).
pub const MAX_KIND_BYTES: usize = 128;

/// The task kinds a worker (or a group) handles.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Kinds {
    /// Every kind (`*`): what a registration without a kind list means.
    #[default]
    Any,
    /// Exactly these kinds.
    Only(BTreeSet<String>),
}

/// Why a kind list was refused (the caller names the setting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KindsError {
    /// An empty item in the list (the list).
    #[error("`{0}`: an empty kind (use `*` for every kind, or list kinds as `a,b`)")]
    Empty(String),
    /// `*` together with named kinds.
    #[error("`*` stands alone: it already means every kind")]
    MixedWildcard,
    /// A kind longer than `MAX_KIND_BYTES`.
    #[error("kind `{kind}` is {len} bytes; at most {MAX_KIND_BYTES}")]
    TooLong {
        /// The kind.
        kind: String,
        /// Its length, in bytes.
        len: usize,
    },
    /// A kind with a control character or whitespace (the kind).
    #[error("kind {0:?} contains a control character or whitespace")]
    BadChar(String),
}

impl Kinds {
    /// Parses `*` or `a,b,c` (items trimmed). An empty item, `*` beside a kind, a kind over
    /// [`MAX_KIND_BYTES`] or one with whitespace or control characters is refused.
    ///
    /// # Errors
    /// [`KindsError`] naming the offending item.
    pub fn parse(s: &str) -> Result<Self, KindsError> {
        let items: Vec<&str> = s.split(',').map(str::trim).collect();
        if items == ["*"] {
            return Ok(Kinds::Any);
        }
        let mut set = BTreeSet::new();
        for k in items {
            if k.is_empty() {
                return Err(KindsError::Empty(s.to_string()));
            }
            if k == "*" {
                return Err(KindsError::MixedWildcard);
            }
            if k.len() > MAX_KIND_BYTES {
                return Err(KindsError::TooLong {
                    kind: k.chars().take(32).collect(),
                    len: k.len(),
                });
            }
            if k.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(KindsError::BadChar(k.to_string()));
            }
            set.insert(k.to_string());
        }
        Ok(Kinds::Only(set))
    }

    /// Exactly these kinds.
    pub fn only<I: IntoIterator<Item = S>, S: Into<String>>(kinds: I) -> Self {
        Kinds::Only(kinds.into_iter().map(Into::into).collect())
    }

    /// Whether `kind` is handled.
    pub fn handles(&self, kind: &str) -> bool {
        match self {
            Kinds::Any => true,
            Kinds::Only(s) => s.contains(kind),
        }
    }

    /// These kinds and `more` (every kind stays every kind).
    pub fn with<I: IntoIterator<Item = S>, S: Into<String>>(self, more: I) -> Self {
        match self {
            Kinds::Any => Kinds::Any,
            Kinds::Only(mut s) => {
                s.extend(more.into_iter().map(Into::into));
                Kinds::Only(s)
            }
        }
    }

    /// The wire form (see the module docs): `*` or `a,b` sorted.
    pub fn wire(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Kinds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Kinds::Any => f.write_str("*"),
            Kinds::Only(s) => {
                for (i, k) in s.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    f.write_str(k)?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_wire() {
        assert_eq!(Kinds::parse("*"), Ok(Kinds::Any));
        assert_eq!(Kinds::parse(" * "), Ok(Kinds::Any));
        let k = Kinds::parse("thumbnail, resize").unwrap();
        assert_eq!(k.wire(), "resize,thumbnail");
        assert!(k.handles("resize") && !k.handles("echo"));
        assert!(Kinds::Any.handles("anything"));
        assert_eq!(k.clone().with(["noop"]).wire(), "noop,resize,thumbnail");
        assert_eq!(Kinds::Any.with(["noop"]), Kinds::Any);
        assert_eq!(Kinds::parse("a,,b"), Err(KindsError::Empty("a,,b".into())));
        assert_eq!(Kinds::parse(""), Err(KindsError::Empty(String::new())));
        assert_eq!(Kinds::parse("a,*"), Err(KindsError::MixedWildcard));
        assert!(matches!(
            Kinds::parse(&"x".repeat(129)),
            Err(KindsError::TooLong { len: 129, .. })
        ));
        assert!(matches!(Kinds::parse("a b"), Err(KindsError::BadChar(_))));
    }
}
