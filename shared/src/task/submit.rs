//! Parsing of an HTTP submission body (`POST /v1/tasks`): one envelope or a JSON array of
//! them, each checked on the producer's exact bytes with the same [`Limits`] as the AMQP
//! ingress, then normalised. Kept apart from the API handler so the fuzz target `submit_body`
//! runs the very same code.

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;

use crate::task::{Envelope, Limits};

/// Why a body was refused (→ 400): a bounded `code`, the human `detail`, and the index of the
/// bad envelope in an array (`None` when the body as a whole is bad).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadSubmission {
    /// `malformed_json`, `empty`, or the envelope's [`Reject::code`](crate::task::Reject::code).
    pub code: &'static str,
    /// What is wrong, for a human.
    pub detail: String,
    /// Which envelope of an array (from 0); `None` for the body as a whole.
    pub index: Option<usize>,
}

/// One accepted envelope of a body.
#[derive(Debug)]
pub struct Submitted {
    /// Parsed and normalised (id generated when absent).
    pub envelope: Envelope,
    /// The producer's exact bytes of this envelope, published unchanged.
    pub raw: Box<RawValue>,
    /// True when the producer gave no `submitted_at` (fleet stamps it in a header).
    pub stamped: bool,
}

/// Parses `body` into envelopes; `default_max_attempts` fills a missing `max_attempts`.
///
/// # Errors
/// [`BadSubmission`] for malformed JSON, an empty array, or the first envelope over a limit
/// or invalid (its index given). Never panics, whatever the bytes.
pub fn parse_body(
    body: &[u8],
    limits: &Limits,
    default_max_attempts: u32,
    now: DateTime<Utc>,
) -> Result<Vec<Submitted>, BadSubmission> {
    let items: Vec<Box<RawValue>> =
        if body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
            serde_json::from_slice(body)
        } else {
            serde_json::from_slice(body).map(|one| vec![one])
        }
        .map_err(|e| BadSubmission {
            code: "malformed_json",
            detail: e.to_string(),
            index: None,
        })?;
    if items.is_empty() {
        return Err(BadSubmission {
            code: "empty",
            detail: "no envelope given".into(),
            index: None,
        });
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, raw) in items.into_iter().enumerate() {
        let bad = |r: crate::task::Reject| BadSubmission {
            code: r.code(),
            detail: r.to_string(),
            index: Some(i),
        };
        let mut envelope = Envelope::parse(raw.get().as_bytes(), limits).map_err(bad)?;
        let stamped = envelope.submitted_at.is_none();
        envelope.normalize(now, default_max_attempts).map_err(bad)?;
        out.push(Submitted {
            envelope,
            raw,
            stamped,
        });
    }
    Ok(out)
}

/// Sets every envelope's fairness `key` to `key` whatever it said (a submit token bound to a
/// key, `FLEET_API_TOKENS` entry `... key=K`): the envelope's bytes are rewritten with the key
/// and checked again against `limits` (an envelope the key pushes over `max_bytes` is refused).
/// Envelopes that carry `key` already are left byte for byte.
///
/// # Errors
/// [`BadSubmission`] of the first envelope that cannot carry the key (its index given).
pub fn bind_key(items: &mut [Submitted], key: &str, limits: &Limits) -> Result<(), BadSubmission> {
    for (i, item) in items.iter_mut().enumerate() {
        if item.envelope.key.as_deref() == Some(key) {
            continue;
        }
        let bad = |code: &'static str, detail: String| BadSubmission {
            code,
            detail,
            index: Some(i),
        };
        let mut map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(item.raw.get())
                .map_err(|e| bad("malformed_json", e.to_string()))?;
        map.insert("key".into(), serde_json::Value::String(key.to_string()));
        let text = serde_json::to_string(&map).map_err(|e| bad("malformed_json", e.to_string()))?;
        Envelope::parse(text.as_bytes(), limits).map_err(|r| {
            bad(
                r.code(),
                format!("with the key `{key}` its token is bound to: {r}"),
            )
        })?;
        item.raw = RawValue::from_string(text).map_err(|e| bad("malformed_json", e.to_string()))?;
        item.envelope.key = Some(key.to_string());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_or_many_and_the_bad_index() {
        let now = Utc::now();
        let l = Limits::default();
        assert_eq!(parse_body(br#"{"kind":"a"}"#, &l, 5, now).unwrap().len(), 1);
        let two = parse_body(br#" [{"kind":"a"}, {"kind":"b"}]"#, &l, 5, now).unwrap();
        assert_eq!(two[1].raw.get(), r#"{"kind":"b"}"#);
        let e =
            parse_body(br#"[{"kind":"a"},{"kind":"b","lane":"bulk"}]"#, &l, 5, now).unwrap_err();
        assert_eq!(e.index, Some(1));
        assert_eq!(parse_body(b"[]", &l, 5, now).unwrap_err().code, "empty");
        assert_eq!(
            parse_body(b"{oops", &l, 5, now).unwrap_err().code,
            "malformed_json"
        );
        let small = Limits {
            max_bytes: 10,
            ..Limits::default()
        };
        assert_eq!(
            parse_body(br#"{"kind":"aaaaaaaaaaaaaaaaaaaaaaaa"}"#, &small, 5, now)
                .unwrap_err()
                .code,
            "oversized"
        );
    }

    #[test]
    fn a_bound_key_replaces_the_envelopes_key() {
        let l = Limits::default();
        let mut items = parse_body(
            br#"[{"kind":"a","key":"U"},{"kind":"b"},{"kind":"c","key":"T"}]"#,
            &l,
            5,
            Utc::now(),
        )
        .unwrap();
        bind_key(&mut items, "T", &l).unwrap();
        for it in &items {
            assert_eq!(it.envelope.key.as_deref(), Some("T"));
            let v: serde_json::Value = serde_json::from_str(it.raw.get()).unwrap();
            assert_eq!(v["key"], "T");
        }
        assert_eq!(items[2].raw.get(), r#"{"kind":"c","key":"T"}"#, "unchanged");
        let small = Limits {
            max_bytes: 20,
            ..Limits::default()
        };
        let mut items = parse_body(br#"{"kind":"abcdefgh"}"#, &small, 5, Utc::now()).unwrap();
        assert_eq!(
            bind_key(&mut items, "tenant", &small).unwrap_err().index,
            Some(0)
        );
    }
}
