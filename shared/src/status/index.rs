//! The task index: browsing tasks by state (`GET /v1/tasks`) and selecting them for bulk
//! actions (`POST /v1/tasks/bulk`).
//!
//! # What it is
//!
//! One sorted set per namespace, `{ns}:tix` ([`Names::task_index`](crate::Names::task_index)):
//! member = task id, score = the run's `submitted_at` (Unix ms; the Redis clock when unknown,
//! and the replay time for a dead-letter replay — a new run). It is written by the status writer
//! that **creates** a run's record (`index_run` in `names/keys.lua`: `status_waiting` from
//! `reserve.lua`, `status_decided` for the scheduler's own states, `status_replayed`,
//! `status_cancelled` for a mark written back from the control stream), inside the script that
//! writes the status anyway: **one `ZADD` per task for its whole life**, no command on any
//! later transition and none outside those scripts.
//!
//! The index holds ids only: a listing reads each candidate's record (`state`, `group`, `kind`,
//! `selector`, `lane`) in a server-side walk (`status/walk.lua`, at most [`STEP`] entries per
//! call, newest first) and filters here. Counts per state are exact for the filters given, up
//! to [`SCAN_MAX`] index entries walked per request (`complete: false` beyond, with the counts
//! of what was walked): counting costs one `HMGET` per indexed task in the time range, on the
//! Redis side, in steps of [`STEP`] — measured 6.1 µs per entry (Redis 7.0, the development
//! machine): 100,000 tasks take about 0.6 s of Redis time in 200 steps of 3 ms, between which
//! other commands run. So the API caches the counts per filter for a few seconds, and a page
//! without counts walks only until it is full. Keeping per-state counters instead would cost
//! a command on every transition (the hot path), which the index must not.
//!
//! # Growth
//!
//! An id whose record is gone (the status TTL passed, a dead letter deleted) is removed from
//! the index by the walk that meets it, and by [`Store::trim_task_index`] (a bounded step the
//! scheduler runs every minute over the entries older than the status TTL). The index never
//! holds many more ids than there are status records.
//!
//! # Redis loss
//!
//! The index, like the statuses, is state that may be lost: after a Redis loss the list shows
//! the runs whose records were written since (every task dispatched, claimed or finished again
//! writes its record; a record re-created by a later transition without its first writer —
//! `running` after a loss — is not indexed until its next run). The broker still holds every
//! task; the list is a view, never the source of truth.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::TaskState;
use crate::error::Result;
use crate::redis::Store;

/// Most index entries one `status/walk.lua` call reads (about 3 ms of Redis time: a
/// 1,000-entry step measured 6.1 ms on the development machine's Redis 7.0).
pub const STEP: usize = 500;
/// Most index entries one listing or selection walks (counts are exact below this).
pub const SCAN_MAX: usize = 200_000;

/// What a listing or a bulk action selects: every task meeting all the given conditions.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Filter {
    /// Only these states (empty: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub states: Vec<String>,
    /// Only tasks whose record names this group (queued, parked, running, and the attempts
    /// that ended there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Only this kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Only tasks whose selector holds every one of these `key=value` pairs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// Only runs submitted at or after this time (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<i64>,
    /// Only runs submitted at or before this time (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<i64>,
}

impl Filter {
    /// Whether `e` meets every condition but the state (the counts' filter).
    pub fn matches_but_state(&self, e: &Entry) -> bool {
        self.group.as_ref().is_none_or(|g| *g == e.group)
            && self.kind.as_ref().is_none_or(|k| *k == e.kind)
            && self
                .labels
                .iter()
                .all(|l| e.selector.split(',').any(|p| p == l))
    }

    /// Whether `e` meets every condition.
    pub fn matches(&self, e: &Entry) -> bool {
        self.matches_but_state(e) && (self.states.is_empty() || self.states.contains(&e.state))
    }

    /// Checks the states are words of [`TaskState`]; `Err` names the first unknown one.
    pub fn check(&self) -> std::result::Result<(), String> {
        for s in &self.states {
            if s.parse::<TaskState>().is_err() {
                return Err(format!("unknown state `{s}`"));
            }
        }
        for l in &self.labels {
            if !l.contains('=') {
                return Err(format!("label `{l}` is not key=value"));
            }
        }
        Ok(())
    }
}

/// One indexed task as a listing sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    /// The task id.
    pub id: String,
    /// Its index score: the run's submitted_at (Unix ms).
    pub submitted_ms: i64,
    /// Its state, as stored.
    pub state: String,
    /// Its group ('' when it has none: delayed, waiting for a worker).
    pub group: String,
    /// Its kind ('' when unknown).
    pub kind: String,
    /// Its selector (`k=v,k2=v2`, '' for none or unknown).
    pub selector: String,
    /// Its lane ('' when unknown).
    pub lane: String,
}

impl Entry {
    /// This entry's place in the walk, as a cursor (the next page starts after it).
    pub fn cursor(&self) -> Cursor {
        Cursor {
            score: self.submitted_ms,
            id: self.id.clone(),
        }
    }
}

/// A place in the index's order (newest first: score descending, then id descending): a
/// page starts after it. Text form `<score>:<id>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The score (Unix ms).
    pub score: i64,
    /// The id at that score.
    pub id: String,
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.score, self.id)
    }
}

impl std::str::FromStr for Cursor {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (score, id) = s
            .split_once(':')
            .ok_or_else(|| format!("cursor `{s}` is not <score>:<id>"))?;
        Ok(Cursor {
            score: score
                .parse()
                .map_err(|_| format!("cursor `{s}`: the score is not a number"))?,
            id: id.to_string(),
        })
    }
}

/// One page of a listing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Page {
    /// The matching tasks after the cursor, newest first, at most the limit.
    pub tasks: Vec<Entry>,
    /// Matching tasks per state over the whole time range (the state filter aside).
    pub counts: BTreeMap<String, u64>,
    /// Where the next page starts (`None`: this is the last one).
    pub next: Option<String>,
    /// Index entries walked.
    pub scanned: u64,
    /// False when the walk stopped at [`SCAN_MAX`] before the end: the counts are those of
    /// the walked part.
    pub complete: bool,
}

/// The ids a selection matched, newest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selected {
    /// The matching entries.
    pub entries: Vec<Entry>,
    /// False when the walk stopped at [`SCAN_MAX`] entries before the end.
    pub complete: bool,
}

/// One call's answer: the live entries read and where the walk stopped (`None`: the end).
type Step = (Vec<Entry>, Option<Cursor>);

impl Store {
    /// One step of the index walk (`status/walk.lua`): at most `max` entries from `from`
    /// (exclusive; `None`: from `until_ms`, or the newest) down to `since_ms`, newest first;
    /// entries whose record is gone are dropped from the index on the way.
    ///
    /// # Errors
    /// Redis unreachable or slow; an answer of the wrong shape.
    pub async fn walk_task_index(
        &self,
        from: Option<&Cursor>,
        until_ms: Option<i64>,
        since_ms: Option<i64>,
        max: usize,
    ) -> Result<Step> {
        let (start, cid) = match from {
            Some(c) => (c.score.to_string(), c.id.clone()),
            None => (
                until_ms.map_or_else(|| "+inf".to_string(), |u| u.to_string()),
                String::new(),
            ),
        };
        let to = since_ms.map_or_else(|| "-inf".to_string(), |s| s.to_string());
        let mut inv = self.scripts.walk.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(start)
            .arg(cid)
            .arg(to)
            .arg(max.clamp(1, STEP));
        let flat: Vec<String> = self.invoke(&inv).await?;
        if flat.len() < 2 || !(flat.len() - 2).is_multiple_of(7) {
            return Err(crate::Error::BadAnswer {
                from: "status/walk.lua",
                detail: format!("{} items", flat.len()),
            });
        }
        let (body, tail) = flat.split_at(flat.len() - 2);
        let entries = body
            .chunks_exact(7)
            .map(|c| Entry {
                id: c[0].clone(),
                submitted_ms: score(&c[1]),
                state: c[2].clone(),
                group: c[3].clone(),
                kind: c[4].clone(),
                selector: c[5].clone(),
                lane: c[6].clone(),
            })
            .collect();
        let stop = (!tail[1].is_empty()).then(|| Cursor {
            score: score(&tail[0]),
            id: tail[1].clone(),
        });
        Ok((entries, stop))
    }

    /// A page of the task list: the tasks matching `f` after `after` (`None`: from the
    /// newest), at most `limit`, newest first; with `counts`, the counts per state of every
    /// task matching `f` but its states (the whole range is walked: see the module docs for
    /// the cost and the bound) — without, the walk stops as soon as the page and its `next`
    /// are known, and [`Page::counts`] holds only what was walked.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn list_tasks(
        &self,
        f: &Filter,
        after: Option<&Cursor>,
        limit: usize,
        counts: bool,
    ) -> Result<Page> {
        let mut page = Page {
            complete: true,
            ..Page::default()
        };
        let mut at: Option<Cursor> = None;
        // Past the caller's cursor: entries at or before it in the walk are counted only.
        let mut past = after.is_none();
        loop {
            let (entries, stop) = self
                .walk_task_index(at.as_ref(), f.until_ms, f.since_ms, STEP)
                .await?;
            for e in entries {
                page.scanned += 1;
                if !past {
                    if let Some(c) = after {
                        past = before(&e.cursor(), c);
                    }
                }
                if !f.matches_but_state(&e) {
                    continue;
                }
                *page.counts.entry(e.state.clone()).or_default() += 1;
                if past && f.matches(&e) {
                    if page.tasks.len() < limit {
                        page.tasks.push(e);
                    } else if page.next.is_none() {
                        page.next = page.tasks.last().map(|l| l.cursor().to_string());
                    }
                }
            }
            match stop {
                None => break,
                Some(_) if !counts && page.next.is_some() => {
                    page.complete = false;
                    break;
                }
                Some(c) if page.scanned as usize >= SCAN_MAX => {
                    page.complete = false;
                    if page.next.is_none() && page.tasks.len() < limit {
                        page.next = Some(c.to_string());
                    }
                    break;
                }
                Some(c) => at = Some(c),
            }
        }
        Ok(page)
    }

    /// Every task matching `f` (all of its conditions), newest first, walking at most
    /// [`SCAN_MAX`] index entries; at most `limit` kept.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn select_tasks(&self, f: &Filter, limit: usize) -> Result<Selected> {
        let mut out = Selected {
            complete: true,
            ..Selected::default()
        };
        let mut at: Option<Cursor> = None;
        let mut scanned = 0usize;
        loop {
            let (entries, stop) = self
                .walk_task_index(at.as_ref(), f.until_ms, f.since_ms, STEP)
                .await?;
            scanned += entries.len();
            out.entries
                .extend(entries.into_iter().filter(|e| f.matches(e)));
            if out.entries.len() >= limit {
                out.entries.truncate(limit);
                break;
            }
            match stop {
                None => break,
                Some(_) if scanned >= SCAN_MAX => {
                    out.complete = false;
                    break;
                }
                Some(c) => at = Some(c),
            }
        }
        Ok(out)
    }

    /// One bounded trim step of the task index (`status/trim.lua`): of its oldest entries
    /// (submitted at or before `older_than_ms`, Unix ms), at most `max` are checked and those
    /// whose status record is gone removed. Returns (removed, checked).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn trim_task_index(&self, older_than_ms: i64, max: usize) -> Result<(u64, u64)> {
        let mut inv = self.scripts.trim.prepare_invoke();
        inv.key(self.names.prefix()).arg(older_than_ms).arg(max);
        let r: Vec<u64> = self.invoke(&inv).await?;
        Ok((
            r.first().copied().unwrap_or(0),
            r.get(1).copied().unwrap_or(0),
        ))
    }
}

/// A score as Redis writes it (an integer here; a float text is cut).
fn score(s: &str) -> i64 {
    s.parse::<i64>()
        .or_else(|_| s.parse::<f64>().map(|f| f as i64))
        .unwrap_or(0)
}

/// Whether `a` comes after `c` in the walk's order (newest first: a lower score, or the same
/// score and a lower id).
fn before(a: &Cursor, c: &Cursor) -> bool {
    a.score < c.score || (a.score == c.score && a.id < c.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(id: &str, state: &str, group: &str, kind: &str, sel: &str) -> Entry {
        Entry {
            id: id.into(),
            submitted_ms: 1,
            state: state.into(),
            group: group.into(),
            kind: kind.into(),
            selector: sel.into(),
            lane: "normal".into(),
        }
    }

    #[test]
    fn filters_match_every_condition() {
        let f = Filter {
            states: vec!["queued".into()],
            group: Some("g1".into()),
            kind: Some("k".into()),
            labels: vec!["zone=a".into()],
            ..Filter::default()
        };
        assert!(f.matches(&e("1", "queued", "g1", "k", "zone=a,gpu=1")));
        assert!(!f.matches(&e("1", "parked", "g1", "k", "zone=a")));
        assert!(f.matches_but_state(&e("1", "parked", "g1", "k", "zone=a")));
        assert!(!f.matches(&e("1", "queued", "g2", "k", "zone=a")));
        assert!(!f.matches(&e("1", "queued", "g1", "j", "zone=a")));
        assert!(!f.matches(&e("1", "queued", "g1", "k", "zone=ab")));
        assert!(Filter::default().matches(&e("1", "x", "", "", "")));
        assert!(Filter {
            states: vec!["nope".into()],
            ..Filter::default()
        }
        .check()
        .is_err());
    }

    #[test]
    fn cursors_round_trip_and_order() {
        let c: Cursor = "17:a:b".parse().unwrap_or(Cursor {
            score: 0,
            id: String::new(),
        });
        assert_eq!((c.score, c.id.as_str()), (17, "a:b"));
        assert_eq!(c.to_string(), "17:a:b");
        assert!("x".parse::<Cursor>().is_err());
        let at = |s, id: &str| Cursor {
            score: s,
            id: id.into(),
        };
        assert!(before(&at(16, "z"), &at(17, "a")));
        assert!(before(&at(17, "a"), &at(17, "b")));
        assert!(!before(&at(17, "b"), &at(17, "b")));
        assert!(!before(&at(18, "a"), &at(17, "b")));
    }
}
