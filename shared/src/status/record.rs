//! The status record as stored: one Redis string per task (`ts:<id>`, [`crate::Names::task`])
//! holding the record's fields as one JSON object of strings — `{"state":"queued","group":…}`
//! — with the status TTL. The scripts read and write it through `names/keys.lua`'s `rec_get`
//! and `rec_put` (one `GET` and one `SET … PX|KEEPTTL` per transition, the TTL in the same
//! command: a hash cost `HMGET` + `HSET` + `PEXPIRE`, BENCHMARKS.md round 20); this module is
//! the Rust side, for readers and tests.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::Result;

/// A record's fields from its stored bytes (`GET ts:<id>`). Every value the scripts write is a
/// string; a number or boolean (a record written by hand) is kept as its JSON text.
///
/// # Errors
/// [`crate::Error::Json`] when the bytes are not a JSON object (not a record fleet wrote).
pub fn decode(raw: &[u8]) -> Result<BTreeMap<String, String>> {
    let m: BTreeMap<String, Value> = serde_json::from_slice(raw)?;
    Ok(m.into_iter()
        .filter_map(|(k, v)| match v {
            Value::String(s) => Some((k, s)),
            Value::Null => None,
            other => Some((k, other.to_string())),
        })
        .collect())
}

/// A record's fields from a `GET` reply (`None`: no record).
///
/// # Errors
/// As [`decode`].
pub fn decode_opt(raw: Option<&[u8]>) -> Result<Option<BTreeMap<String, String>>> {
    raw.map(decode).transpose()
}

/// The stored form of a record with these fields (name, value), as the scripts write it.
pub fn encode<'a>(fields: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let m: serde_json::Map<String, Value> = fields
        .into_iter()
        .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
        .collect();
    Value::Object(m).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_reads_numbers_as_their_text() {
        let raw = encode([("state", "queued"), ("queued_at", "1764900000000")]);
        let m = decode(raw.as_bytes()).unwrap();
        assert_eq!(m["state"], "queued");
        assert_eq!(m["queued_at"], "1764900000000");
        let m = decode(br#"{"attempt":2,"state":"running","x":null}"#).unwrap();
        assert_eq!(
            (m["attempt"].as_str(), m.len()),
            ("2", 2),
            "numbers as text, nulls absent"
        );
        // cjson writes '/' as "\/".
        assert_eq!(decode(br#"{"error":"a\/b"}"#).unwrap()["error"], "a/b");
        assert!(decode(b"x").is_err());
        assert!(decode(b"[1]").is_err());
        assert_eq!(decode_opt(None).unwrap(), None);
    }
}
