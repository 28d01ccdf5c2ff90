//! Reading status records: the typed JSON of `GET /v1/tasks/{id}` and the attempt history.

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, Utc};
use deadpool_redis::redis;
use serde_json::{Map, Value};

use super::{AttemptOutcome, TaskState, ATTEMPT_LOG_MAX};
use crate::error::Result;
use crate::redis::Store;

/// Status fields that hold whole numbers.
const INTEGER_FIELDS: &[&str] = &["attempt", "max_attempts"];

/// A status record as the API answers it (`GET /v1/tasks/{id}`; schema
/// `shared/schema/status.schema.json`): typed JSON instead of Redis' strings.
///
/// * `id` is added; `attempt` (and `max_attempts`) are integers;
/// * every `*_at` field (stored as Unix milliseconds) and `not_before` become RFC 3339 UTC
///   strings with millisecond precision (`2026-11-30T10:48:01.123Z`);
/// * `result` is the handler's JSON value; a result cut at the status text limit
///   ([`MAX_STATUS_TEXT`](super::MAX_STATUS_TEXT) bytes, no longer valid JSON) stays a string and
///   `result_truncated: true` says so;
/// * a field absent from Redis is absent here (never `null` or `""`); any other field is
///   passed through as a string (forward compatibility).
pub fn typed(id: &str, fields: BTreeMap<String, String>) -> Value {
    let mut out = Map::new();
    out.insert("id".into(), Value::String(id.to_string()));
    for (k, v) in fields {
        // The run record (run_base, run_owner, …) and the dedupe mark (dd, ddx) are fleet's
        // own bookkeeping.
        if v.is_empty() || k.starts_with("run_") || k == "dd" || k == "ddx" {
            continue;
        }
        let typed = if INTEGER_FIELDS.contains(&k.as_str()) {
            v.parse::<u64>()
                .map(Value::from)
                .unwrap_or(Value::String(v))
        } else if k.ends_with("_at") || k == "not_before" {
            time(&v).map(Value::String).unwrap_or(Value::String(v))
        } else if k == "after" {
            // A waiting batch member's parents: stored as a JSON array of ids.
            serde_json::from_str::<Value>(&v).unwrap_or(Value::String(v))
        } else if k == "result" {
            match serde_json::from_str::<Value>(&v) {
                Ok(j) => j,
                Err(_) => {
                    out.insert("result_truncated".into(), Value::Bool(true));
                    Value::String(v)
                }
            }
        } else {
            Value::String(v)
        };
        out.insert(k, typed);
    }
    Value::Object(out)
}

/// One attempt log entry as the API answers it (`attempts[]` of `GET /v1/tasks/{id}`): the
/// stored JSON (`names/keys.lua` `log_attempt`) with `attempt` an integer and `started_at` /
/// `finished_at` (Redis-clock Unix milliseconds) as RFC 3339 UTC strings; absent fields stay
/// absent. `None` for an entry that is not a JSON object. Bytes that are not UTF-8 (an error
/// text cut inside a character) are replaced, not refused.
pub fn typed_attempt(raw: &[u8]) -> Option<Value> {
    let Value::Object(m) = serde_json::from_str::<Value>(&String::from_utf8_lossy(raw)).ok()?
    else {
        return None;
    };
    let mut out = Map::new();
    for (k, v) in m {
        let typed = match (k.as_str(), &v) {
            ("started_at" | "finished_at", Value::Number(n)) => {
                match n.as_i64().and_then(|ms| time(&ms.to_string())) {
                    Some(t) => Value::String(t),
                    None => continue,
                }
            }
            ("attempt", Value::Number(n)) => match n.as_f64() {
                // cjson writes numbers as floats when it must; an attempt is a whole number.
                Some(f) if f >= 0.0 && f.fract() == 0.0 => Value::from(f as u64),
                _ => continue,
            },
            (_, Value::String(s)) if s.is_empty() => continue,
            _ => v,
        };
        out.insert(k, typed);
    }
    Some(Value::Object(out))
}

/// A task's attempts from its two sources: the attempt log (`raw`: the `ta:<id>` list, see
/// `names/keys.lua`) and the status record (`record`), which keeps the success that ended the task
/// (finish.lua logs every other outcome, but not a success it writes into the record: a task
/// that succeeds at once then costs no log key). The record's success is added unless the log
/// already has it (same attempt and end); entries are ordered by `finished_at` (Redis time,
/// so one clock), the latest [`ATTEMPT_LOG_MAX`] kept.
pub fn attempt_history(record: &BTreeMap<String, String>, raw: &[Vec<u8>]) -> Vec<Value> {
    let mut out: Vec<Value> = raw.iter().filter_map(|r| typed_attempt(r)).collect();
    if record
        .get("state")
        .and_then(|s| s.parse::<TaskState>().ok())
        == Some(TaskState::Succeeded)
    {
        let mut e = Map::new();
        if let Some(a) = record.get("attempt").and_then(|a| a.parse::<u64>().ok()) {
            e.insert("attempt".into(), Value::from(a));
        }
        if let Some(w) = record.get("worker").filter(|w| !w.is_empty()) {
            e.insert("worker".into(), Value::String(w.clone()));
        }
        for k in ["started_at", "finished_at"] {
            if let Some(t) = record.get(k).and_then(|v| time(v)) {
                e.insert(k.into(), Value::String(t));
            }
        }
        e.insert(
            "outcome".into(),
            Value::String(AttemptOutcome::Succeeded.to_string()),
        );
        let e = Value::Object(e);
        if !out.iter().any(|x| {
            x["outcome"] == AttemptOutcome::Succeeded.as_str()
                && x["attempt"] == e["attempt"]
                && x["finished_at"] == e["finished_at"]
        }) {
            out.push(e);
        }
    }
    // RFC 3339 UTC strings of one format sort by time; the sort is stable for equal ends.
    out.sort_by(|a, b| a["finished_at"].as_str().cmp(&b["finished_at"].as_str()));
    if out.len() > ATTEMPT_LOG_MAX {
        out.drain(..out.len() - ATTEMPT_LOG_MAX);
    }
    out
}

/// Unix milliseconds → RFC 3339 UTC with milliseconds (`2026-11-30T10:48:01.123Z`); `""` for
/// 0 or less (never recorded).
pub fn rfc3339_ms(ms: i64) -> String {
    if ms <= 0 {
        return String::new();
    }
    time(&ms.to_string()).unwrap_or_default()
}

/// Unix milliseconds or an RFC 3339 time → RFC 3339 UTC with milliseconds.
fn time(v: &str) -> Option<String> {
    let t: DateTime<Utc> = match v.parse::<i64>() {
        Ok(ms) => DateTime::from_timestamp_millis(ms)?,
        Err(_) => DateTime::parse_from_rfc3339(v).ok()?.with_timezone(&Utc),
    };
    Some(t.to_rfc3339_opts(SecondsFormat::Millis, true))
}

impl Store {
    /// A task's state alone (`None`: unknown, or expired from Redis), as stored.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn task_state(&self, id: &str) -> Result<Option<String>> {
        self.query(redis::cmd("HGET").arg(self.names.task(id)).arg("state"))
            .await
    }

    /// The states of many tasks in one round trip (pipelined HGETs), in the order asked;
    /// `None` for an unknown one.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn task_states(&self, ids: &[&str]) -> Result<Vec<Option<String>>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut p = redis::pipe();
        for id in ids {
            p.cmd("HGET").arg(self.names.task(id)).arg("state");
        }
        self.pipe(&p).await
    }

    /// The `result` field of many tasks in one round trip (pipelined HGETs), in the order
    /// asked; `None` for a task without one.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn task_results(&self, ids: &[&str]) -> Result<Vec<Option<String>>> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut p = redis::pipe();
        for id in ids {
            p.cmd("HGET").arg(self.names.task(id)).arg("result");
        }
        self.pipe(&p).await
    }

    /// A task's status fields, `None` when unknown (never seen, or expired from Redis; a record
    /// that holds only a dedupe mark, for the moment between a submission's routing and its
    /// first state, is no status yet).
    pub async fn task_status(&self, id: &str) -> Result<Option<BTreeMap<String, String>>> {
        let m: BTreeMap<String, String> = self
            .query(redis::cmd("HGETALL").arg(self.names.task(id)))
            .await?;
        Ok(if m.contains_key("state") {
            Some(m)
        } else {
            None
        })
    }

    /// A task's attempts, oldest first ([`attempt_history`] of its status record and attempt
    /// log; at most [`ATTEMPT_LOG_MAX`]): one entry per attempt that ended, with its worker,
    /// times, outcome (`succeeded`, `failed` — another attempt follows —, `dead`, `expired`,
    /// `lost` — its worker died or left mid-run), error and reason. Empty when none ended yet or
    /// the records expired. The log survives a dead-letter replay (the replayed run starts
    /// again from attempt 1 after the dead one).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn task_attempts(&self, id: &str) -> Result<Vec<Value>> {
        Ok(self
            .task_status_with_attempts(id)
            .await?
            .map(|(_, a)| a)
            .unwrap_or_default())
    }

    /// A task's status fields and its attempts ([`Store::task_attempts`]) in one round trip;
    /// `None` when the status is unknown (never seen, or expired from Redis).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn task_status_with_attempts(
        &self,
        id: &str,
    ) -> Result<Option<(BTreeMap<String, String>, Vec<Value>)>> {
        let mut p = redis::pipe();
        p.cmd("HGETALL")
            .arg(self.names.task(id))
            .cmd("LRANGE")
            .arg(self.names.attempts(id))
            .arg(0)
            .arg(-1);
        let (record, raw): (BTreeMap<String, String>, Vec<Vec<u8>>) = self.pipe(&p).await?;
        // A record holding only a dedupe mark (between a submission's routing and its first
        // state) is no status yet.
        if !record.contains_key("state") {
            return Ok(None);
        }
        let attempts = attempt_history(&record, &raw);
        Ok(Some((record, attempts)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn typed_status_has_numbers_times_and_json() {
        let v = typed(
            "t1",
            rec(&[
                ("state", "succeeded"),
                ("attempt", "2"),
                ("queued_at", "1796028370236"),
                ("not_before", "2026-12-01T11:00:00+01:00"),
                ("result", r#"{"hello":"world"}"#),
                ("worker", "w1"),
                ("error", ""),
            ]),
        );
        assert_eq!(
            v,
            json!({"id": "t1", "state": "succeeded", "attempt": 2, "queued_at": "2026-11-30T08:46:10.236Z",
                   "not_before": "2026-12-01T10:00:00.000Z", "result": {"hello": "world"}, "worker": "w1"})
        );
    }

    #[test]
    fn attempt_entries_are_typed() {
        let e = typed_attempt(br#"{"attempt":2,"worker":"w1","started_at":1796028370236,"finished_at":1796028371000,"outcome":"failed","error":"boom","reason":""}"#);
        assert_eq!(
            e,
            Some(
                json!({"attempt": 2, "worker": "w1", "started_at": "2026-11-30T08:46:10.236Z",
                        "finished_at": "2026-11-30T08:46:11.000Z", "outcome": "failed", "error": "boom"})
            )
        );
        assert_eq!(typed_attempt(b"[1]"), None);
        assert_eq!(typed_attempt(b"not json"), None);
    }

    #[test]
    fn the_records_success_joins_the_log() {
        let raw = vec![br#"{"attempt":1,"worker":"w1","started_at":1796028370000,"finished_at":1796028370100,"outcome":"failed","error":"boom"}"#.to_vec()];
        let record = rec(&[
            ("state", "succeeded"),
            ("attempt", "2"),
            ("worker", "w2"),
            ("started_at", "1796028371000"),
            ("finished_at", "1796028371500"),
            ("result", "{}"),
        ]);
        let h = attempt_history(&record, &raw);
        assert_eq!(
            h,
            vec![
                json!({"attempt": 1, "worker": "w1", "started_at": "2026-11-30T08:46:10.000Z", "finished_at": "2026-11-30T08:46:10.100Z", "outcome": "failed", "error": "boom"}),
                json!({"attempt": 2, "worker": "w2", "started_at": "2026-11-30T08:46:11.000Z", "finished_at": "2026-11-30T08:46:11.500Z", "outcome": "succeeded"}),
            ]
        );
        // Already logged (a success the record did not describe when it was written): once.
        let mut both = raw.clone();
        both.push(br#"{"attempt":2,"worker":"w2","started_at":1796028371000,"finished_at":1796028371500,"outcome":"succeeded"}"#.to_vec());
        assert_eq!(attempt_history(&record, &both), h);
        // Not succeeded: the log alone; nothing at all: empty.
        let dead = rec(&[("state", "dead"), ("attempt", "1"), ("worker", "w1")]);
        assert_eq!(attempt_history(&dead, &raw).len(), 1);
        assert!(attempt_history(&BTreeMap::new(), &[]).is_empty());
        // Capped at the latest ATTEMPT_LOG_MAX.
        let many: Vec<Vec<u8>> = (0..ATTEMPT_LOG_MAX as i64)
            .map(|i| {
                format!(
                    r#"{{"attempt":{},"outcome":"failed","finished_at":{}}}"#,
                    i + 1,
                    1796028360000 + i
                )
                .into_bytes()
            })
            .collect();
        let h = attempt_history(&record, &many);
        assert_eq!(
            (
                h.len(),
                &h[0]["attempt"],
                &h[ATTEMPT_LOG_MAX - 1]["outcome"]
            ),
            (ATTEMPT_LOG_MAX, &json!(2), &json!("succeeded"))
        );
    }

    #[test]
    fn the_attempt_log_cap_is_the_scripts() {
        let line = format!("local ATTEMPT_LOG_MAX = {ATTEMPT_LOG_MAX}\n");
        assert!(
            include_str!("../names/keys.lua").contains(&line),
            "keys.lua and fleet::status disagree on the attempt log cap"
        );
    }

    #[test]
    fn a_cut_result_stays_text_and_says_so() {
        let v = typed("t", rec(&[("result", "{\"a\": \"xxx…")]));
        assert_eq!(v["result"], "{\"a\": \"xxx…");
        assert_eq!(v["result_truncated"], true);
        // A result that is a JSON string is that string.
        assert_eq!(typed("t", rec(&[("result", "\"ok\"")]))["result"], "ok");
    }
}
