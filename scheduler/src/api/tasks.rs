//! Browsing tasks and acting on many at once (issue 32, items 3 and 4), over the task index
//! ([`fleet::status::index`]).
//!
//! # `GET /v1/tasks` (role `read`)
//!
//! Query: `state` (a [`TaskState`] word; repeated or comma-separated for several), `group`,
//! `kind`, `label=k=v` (repeated or comma-separated: the task's selector holds every pair),
//! `since` / `until` (RFC 3339 or Unix ms: when the run was submitted), `cursor` (the `next`
//! of the previous page), `limit` (1-1000, default 50). Answer 200:
//!
//! ```json
//! {"tasks": [{"id", "state", "group", "kind", "lane", "selector", "submitted_at"}],
//!  "counts": {"queued": 12, ...every state, 0 included},
//!  "total": 12, "next": "1796028370236:t-9" | null, "scanned": 250, "complete": true}
//! ```
//!
//! `tasks`: newest first (the run's submission time, then id), after the cursor. `counts`: every
//! task matching the other filters, per state, over the whole time range (exact unless
//! `complete` is false: see the index's bound), computed at most every [`COUNTS_FOR`] per
//! filter on each replica (a bulk run drops them) — between, a page walks only until it is
//! full; `total`: the counts of the states asked for (all when no state is given). 400 for an unknown state, a bad time, label or cursor; 503 Redis.
//!
//! # `POST /v1/tasks/bulk` (role `admin`)
//!
//! Body: `{"action": "cancel" | "retry" | "delete", "ids": [...] | "query": {"state", "group",
//! "kind", "label", "since", "until"}, "dry_run": bool, "limit": n, "reason": "..."}` (exactly
//! one of `ids` and `query`; `limit` 1-100,000, default 10,000; `reason` for a cancel).
//!
//! The action's own states narrow the selection: **cancel** takes tasks not yet ended (waiting, delayed,
//! waiting_for_worker, parked, queued, running, retrying); **retry** (a replay: the task
//! submitted again as a new run) takes dead, expired and cancelled tasks; **delete** (its dead
//! letter removed for good, and its status record with it) takes dead and expired tasks. A
//! dead or expired task is replayed from its dead letter (`<ns>.dead`); a **cancelled** one —
//! never in the dead-letter queue — from `<ns>.cancelled`, where the scheduler or worker that
//! next reached its message kept it (confirmed) before acking it. A cancelled task whose
//! message has not been reached yet (it still waits in its queue) is not there: `skipped`.
//!
//! * `"dry_run": true` → 200 `{"action", "dry_run": true, "count", "sample": [first 20 ids],
//!   "query", "complete", "ineligible": {state: n}}` (`ineligible`: given ids the action does
//!   not take, by state — `unknown` for no record). Nothing is done.
//! * otherwise → 200 `{"action", "count", "applied", "skipped", "failed", "failures": [[id,
//!   why], ...first 20], "complete"}`. **The guarantee:** the selection is evaluated again
//!   when the run starts (the same query or ids), so `count` equals a dry run's made just
//!   before when nothing changed in between; each selected task is then acted on unless its
//!   state changed before its turn (it ended, or was cancelled or replayed by someone else) —
//!   those are `skipped`; `failed` are those the broker or Redis refused (nothing promised for
//!   them). applied + skipped + failed = count.
//!
//! **Rate bound.** A run acts in batches of [`BATCH`] paced to at most [`RATE`] tasks per
//! second, and one run at a time per replica (a second waits): a bulk action over a million
//! tasks never starves dispatch of Redis or the broker. A cancel appends one control-stream
//! record per task (one batch of publishes per batch, every confirm awaited — the promise of
//! `POST /v1/tasks/{id}/cancel`) before marking Redis (`cancel.lua`), exactly as the single
//! cancel does. Retry and delete read the dead queue once per run (holding its reader lease)
//! and replay or delete letter by letter with confirms, below the bound (a retry that takes
//! cancelled tasks reads `<ns>.cancelled` once more).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use fleet::broker::dead::{self, Selection};
use fleet::control::{self, Mode, Record};
use fleet::status::index::{Cursor, Entry, Filter};
use fleet::status::{rfc3339_ms, TaskState};
use serde_json::{json, Map, Value};
use tokio::sync::Semaphore;

use super::{error, AppState};

/// Default and largest page of `GET /v1/tasks`.
const PAGE_DEFAULT: usize = 50;
const PAGE_MAX: usize = 1000;
/// Default and largest number of tasks one bulk action takes.
const BULK_DEFAULT: usize = 10_000;
const BULK_MAX: usize = 100_000;
/// Ids a dry run shows.
const SAMPLE: usize = 20;
/// Tasks acted on per batch of a bulk run.
pub const BATCH: usize = 200;
/// Most tasks a bulk run acts on per second.
pub const RATE: u32 = 2000;
/// Failures listed in a run's answer.
const FAILURES_SHOWN: usize = 20;

/// One bulk run at a time on this replica.
static BULK: Semaphore = Semaphore::const_new(1);

/// The routes that only read (role `read`).
pub fn read_routes() -> Router<AppState> {
    Router::new().route("/v1/tasks", get(list))
}

/// The routes that act (role `admin`).
pub fn admin_routes() -> Router<AppState> {
    Router::new().route("/v1/tasks/bulk", post(bulk))
}

/// A time as RFC 3339 or Unix ms.
fn time_ms(v: &str) -> Result<i64, String> {
    if let Ok(ms) = v.parse::<i64>() {
        return Ok(ms);
    }
    chrono::DateTime::parse_from_rfc3339(v)
        .map(|t| t.timestamp_millis())
        .map_err(|_| format!("`{v}` is neither RFC 3339 nor Unix milliseconds"))
}

/// The filter, cursor and limit of a listing's query pairs (or a bulk body's `query`).
fn parse_pairs(
    pairs: &[(String, String)],
) -> Result<(Filter, Option<Cursor>, Option<usize>), String> {
    let mut f = Filter::default();
    let mut cursor = None;
    let mut limit = None;
    let many = |v: &str| {
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    for (k, v) in pairs {
        let blank = v.trim().is_empty();
        match k.as_str() {
            "state" => f.states.extend(many(v)),
            "group" if !blank => f.group = Some(v.clone()),
            "kind" if !blank => f.kind = Some(v.clone()),
            "label" => f.labels.extend(many(v)),
            "since" if !blank => f.since_ms = Some(time_ms(v)?),
            "until" if !blank => f.until_ms = Some(time_ms(v)?),
            "cursor" if !blank => cursor = Some(v.parse::<Cursor>()?),
            "limit" if !blank => {
                limit = Some(
                    v.parse::<usize>()
                        .map_err(|_| format!("limit `{v}` is not a number"))?,
                )
            }
            "group" | "kind" | "since" | "until" | "cursor" | "limit" => {}
            other => return Err(format!("unknown filter `{other}`")),
        }
    }
    f.check()?;
    Ok((f, cursor, limit))
}

/// A bulk body's `query` object as listing pairs (strings, or arrays of strings for `state`
/// and `label`; numbers for times).
fn query_pairs(q: &Map<String, Value>) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (k, v) in q {
        match v {
            Value::Null => {}
            Value::String(s) => out.push((k.clone(), s.clone())),
            Value::Number(n) => out.push((k.clone(), n.to_string())),
            Value::Array(a) => {
                for x in a {
                    match x {
                        Value::String(s) => out.push((k.clone(), s.clone())),
                        _ => return Err(format!("`query.{k}` must hold strings")),
                    }
                }
            }
            _ => {
                return Err(format!(
                    "`query.{k}` must be a string, a number or an array"
                ))
            }
        }
    }
    Ok(out)
}

/// One listed task as the API answers it.
fn entry_json(e: &Entry) -> Value {
    json!({
        "id": e.id,
        "state": e.state,
        "group": e.group,
        "kind": e.kind,
        "lane": e.lane,
        "selector": e.selector,
        "submitted_at": rfc3339_ms(e.submitted_ms),
    })
}

async fn list(State(st): State<AppState>, Query(pairs): Query<Vec<(String, String)>>) -> Response {
    let (f, cursor, limit) = match parse_pairs(&pairs) {
        Ok(p) => p,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_query", e),
    };
    let limit = limit.unwrap_or(PAGE_DEFAULT).clamp(1, PAGE_MAX);
    let key = counts_key(&st, &f);
    let cached = counts_cache(|c| c.get(&key).filter(|e| e.0.elapsed() < COUNTS_FOR).cloned());
    let page = match st
        .store
        .list_tasks(&f, cursor.as_ref(), limit, cached.is_none())
        .await
    {
        Ok(p) => p,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string()),
    };
    let (walked, complete, scanned) = match cached {
        Some((_, c, complete, scanned)) => (c, complete, scanned),
        None => {
            let e = (
                Instant::now(),
                page.counts.clone(),
                page.complete,
                page.scanned,
            );
            counts_cache(|c| {
                if c.len() >= COUNTS_KEPT {
                    c.clear();
                }
                c.insert(key, e);
            });
            (page.counts, page.complete, page.scanned)
        }
    };
    let mut counts: BTreeMap<String, u64> =
        TaskState::ALL.iter().map(|s| (s.to_string(), 0)).collect();
    counts.extend(walked);
    let total: u64 = counts
        .iter()
        .filter(|(s, _)| f.states.is_empty() || f.states.contains(s))
        .map(|(_, n)| n)
        .sum();
    Json(json!({
        "tasks": page.tasks.iter().map(entry_json).collect::<Vec<_>>(),
        "counts": counts,
        "total": total,
        "next": page.next,
        "scanned": scanned,
        "complete": complete,
    }))
    .into_response()
}

/// How long a listing's counts are reused for the same filter (on this replica).
const COUNTS_FOR: Duration = Duration::from_secs(5);
/// Most filters whose counts are kept (all are dropped past it).
const COUNTS_KEPT: usize = 64;

/// Counts per filter: (when, counts, complete, scanned).
type CountsCache = std::collections::HashMap<String, (Instant, BTreeMap<String, u64>, bool, u64)>;

/// Runs `f` on this process's counts cache (a poisoned lock is recovered: it holds only a
/// cache).
fn counts_cache<T>(f: impl FnOnce(&mut CountsCache) -> T) -> T {
    static CACHE: std::sync::OnceLock<std::sync::Mutex<CountsCache>> = std::sync::OnceLock::new();
    let m = CACHE.get_or_init(Default::default);
    let mut g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    f(&mut g)
}

/// The cache key of a listing's counts: its namespace and every filter but the states.
fn counts_key(st: &AppState, f: &Filter) -> String {
    let mut k = f.clone();
    k.states.clear();
    format!("{}|{}", st.store.names.prefix(), json!(k))
}

/// A bulk action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Cancel,
    Retry,
    Delete,
}

impl Action {
    fn parse(s: &str) -> Option<Action> {
        match s {
            "cancel" => Some(Action::Cancel),
            "retry" => Some(Action::Retry),
            "delete" => Some(Action::Delete),
            _ => None,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Action::Cancel => "cancel",
            Action::Retry => "retry",
            Action::Delete => "delete",
        }
    }

    /// The states this action takes.
    fn takes(self) -> &'static [TaskState] {
        match self {
            Action::Cancel => &[
                TaskState::Waiting,
                TaskState::Delayed,
                TaskState::WaitingForWorker,
                TaskState::Parked,
                TaskState::Queued,
                TaskState::Running,
                TaskState::Retrying,
            ],
            Action::Retry => &[TaskState::Dead, TaskState::Expired, TaskState::Cancelled],
            Action::Delete => &[TaskState::Dead, TaskState::Expired],
        }
    }

    fn takes_word(self, s: &str) -> bool {
        self.takes().iter().any(|t| t.as_str() == s)
    }
}

/// A parsed bulk request.
struct Bulk {
    action: Action,
    ids: Option<Vec<String>>,
    filter: Option<Filter>,
    dry_run: bool,
    limit: usize,
    reason: String,
}

fn parse_bulk(body: &[u8]) -> Result<Bulk, String> {
    let Value::Object(m) =
        serde_json::from_slice::<Value>(body).map_err(|e| format!("malformed JSON: {e}"))?
    else {
        return Err("the body must be a JSON object".into());
    };
    let action = m
        .get("action")
        .and_then(Value::as_str)
        .and_then(Action::parse)
        .ok_or("`action` must be \"cancel\", \"retry\" or \"delete\"")?;
    let ids = match m.get("ids") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or("`ids` must be an array of strings")?,
        ),
        Some(_) => return Err("`ids` must be an array of strings".into()),
    };
    let filter = match m.get("query") {
        None | Some(Value::Null) => None,
        Some(Value::Object(q)) => {
            let (f, cursor, limit) = parse_pairs(&query_pairs(q)?)?;
            if cursor.is_some() || limit.is_some() {
                return Err("`query` takes filters only (no cursor or limit)".into());
            }
            Some(f)
        }
        Some(_) => return Err("`query` must be an object of filters".into()),
    };
    match (&ids, &filter) {
        (Some(i), None) if !i.is_empty() => {}
        (None, Some(_)) => {}
        _ => return Err("give a non-empty `ids` array or a `query` object (not both)".into()),
    }
    let dry_run = match m.get("dry_run") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err("`dry_run` must be a boolean".into()),
    };
    let limit = match m.get("limit") {
        None | Some(Value::Null) => BULK_DEFAULT,
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=BULK_MAX as u64).contains(n))
            .ok_or(format!("`limit` must be 1-{BULK_MAX}"))? as usize,
    };
    let reason = match m.get("reason") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("`reason` must be a string".into()),
    };
    Ok(Bulk {
        action,
        ids,
        filter,
        dry_run,
        limit,
        reason,
    })
}

/// What a bulk request selects now.
struct Chosen {
    ids: Vec<String>,
    /// Each selected id's state then (`ids`' order): a retry replays a cancelled task from
    /// `<ns>.cancelled`, any other from `<ns>.dead`.
    states: Vec<String>,
    complete: bool,
    ineligible: BTreeMap<String, u64>,
}

/// Evaluates the request's selection (see the module docs); `Err` is the answer to give.
async fn choose(st: &AppState, b: &Bulk) -> Result<Chosen, Response> {
    let redis = |e: fleet::Error| error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string());
    if let Some(ids) = &b.ids {
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let states = st.store.task_states(&refs).await.map_err(redis)?;
        let mut out = Chosen {
            ids: Vec::new(),
            states: Vec::new(),
            complete: true,
            ineligible: BTreeMap::new(),
        };
        let mut seen = std::collections::HashSet::new();
        for (id, s) in ids.iter().zip(states) {
            if !seen.insert(id.as_str()) {
                continue;
            }
            match s {
                Some(s) if b.action.takes_word(&s) => {
                    if out.ids.len() < b.limit {
                        out.ids.push(id.clone());
                        out.states.push(s);
                    }
                }
                Some(s) => *out.ineligible.entry(s).or_default() += 1,
                None => *out.ineligible.entry("unknown".into()).or_default() += 1,
            }
        }
        return Ok(out);
    }
    let mut f = b.filter.clone().unwrap_or_default();
    f.states = if f.states.is_empty() {
        b.action.takes().iter().map(|s| s.to_string()).collect()
    } else {
        f.states
            .into_iter()
            .filter(|s| b.action.takes_word(s))
            .collect()
    };
    if f.states.is_empty() {
        return Ok(Chosen {
            ids: Vec::new(),
            states: Vec::new(),
            complete: true,
            ineligible: BTreeMap::new(),
        });
    }
    let sel = st.store.select_tasks(&f, b.limit).await.map_err(redis)?;
    let (ids, states) = sel.entries.into_iter().map(|e| (e.id, e.state)).unzip();
    Ok(Chosen {
        ids,
        states,
        complete: sel.complete,
        ineligible: BTreeMap::new(),
    })
}

/// What a run did.
#[derive(Default)]
struct Tally {
    applied: u64,
    skipped: u64,
    failed: u64,
    failures: Vec<(String, String)>,
}

impl Tally {
    fn fail(&mut self, id: &str, why: String) {
        self.failed += 1;
        if self.failures.len() < FAILURES_SHOWN {
            self.failures.push((id.to_string(), why));
        }
    }
}

/// Sleeps so that `done` actions since `start` keep to [`RATE`] per second.
pub(super) async fn pace(start: Instant, done: usize) {
    let due = start + Duration::from_secs_f64(done as f64 / f64::from(RATE));
    tokio::time::sleep_until(due.into()).await;
}

async fn bulk(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let b = match parse_bulk(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e),
    };
    let query = b.filter.as_ref().map(|f| json!(f));
    if b.dry_run {
        let chosen = match choose(&st, &b).await {
            Ok(c) => c,
            Err(r) => return r,
        };
        return Json(json!({
            "action": b.action.as_str(),
            "dry_run": true,
            "count": chosen.ids.len(),
            "sample": chosen.ids.iter().take(SAMPLE).collect::<Vec<_>>(),
            "query": query,
            "complete": chosen.complete,
            "ineligible": chosen.ineligible,
        }))
        .into_response();
    }
    let Ok(_one) = BULK.acquire().await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "closed", "shutting down");
    };
    let chosen = match choose(&st, &b).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let who = super::caller(&st, &headers);
    // The counts change: listings count again.
    counts_cache(|c| c.clear());
    // The audit target: the query, or the ids (the first ones, and how many).
    let target = match (&b.filter, &b.ids) {
        (Some(_), _) => json!({"query": query}),
        (None, Some(ids)) => {
            json!({"ids": ids.iter().take(SAMPLE).collect::<Vec<_>>(), "ids_given": ids.len()})
        }
        (None, None) => Value::Null,
    };
    let action = format!("bulk_{}", b.action.as_str());
    // The bulk action's own audit record: its cancels name it (one audit entry for the whole
    // action, `fleet::control::Op::Cancel::bulk`). Written before the first task is touched,
    // with the count selected — a run cut short (a crash mid-way) is still in the log — and
    // nothing is done when the broker does not take it (the answer says applied / skipped /
    // failed).
    let audit = Record::audit(
        &action,
        target.clone(),
        chosen.ids.len() as u64,
        &who,
        &b.reason,
        st.store.clock.now_ms(),
    );
    if let Err(e) = append_audit(&st, &audit).await {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "broker_unavailable",
            format!("the bulk action was not recorded (nothing done; try again): {e}"),
        );
    }
    let tally = match b.action {
        Action::Cancel => cancel_all(&st, &chosen.ids, &who, &b.reason, &audit.id).await,
        Action::Retry | Action::Delete => match dead_letters(&st, b.action, &chosen).await {
            Ok(t) => t,
            Err(r) => return r,
        },
    };
    tracing::info!(
        action = b.action.as_str(),
        by = %who.name,
        count = chosen.ids.len(),
        applied = tally.applied,
        skipped = tally.skipped,
        failed = tally.failed,
        "bulk action"
    );
    Json(json!({
        "action": b.action.as_str(),
        "count": chosen.ids.len(),
        "applied": tally.applied,
        "skipped": tally.skipped,
        "failed": tally.failed,
        "failures": tally.failures,
        "query": query,
        "complete": chosen.complete,
    }))
    .into_response()
}

/// What [`append_cancels`] did with one chunk of ids.
pub(super) struct Appended {
    /// Ids whose cancel record the broker did not confirm (nothing promised for them), with
    /// the error.
    pub refused: Vec<(String, fleet::Error)>,
    /// The Redis marks of the ids recorded (`cancel.lua`, [`Mode::Api`]): per id, in order,
    /// its state before ([`fleet::Store::cancel`]); `Err((n, e))` when Redis failed for those
    /// `n` — the promise still holds: every replica writes the marks from the stream.
    pub marks: Result<Vec<Option<String>>, (u64, fleet::Error)>,
}

/// The cancel of a bulk action or of a batch's members, one chunk (≤ [`BATCH`] ids): one
/// control-stream record per id naming `bulk` (the action's own record, so the audit log has
/// one entry for it), appended together with every confirm awaited — the promise — then the
/// marks of those confirmed, in one `cancel.lua` call. `now`: the records' time (when the
/// cancel was accepted, Unix ms; a batch's first cancel passes its batch record's).
pub(super) async fn append_cancels(
    st: &AppState,
    ids: &[impl AsRef<str>],
    who: &fleet::settings::Caller,
    reason: &str,
    bulk: &str,
    now: i64,
) -> Appended {
    let recs: Vec<Record> = ids
        .iter()
        .map(|id| Record::cancel(id.as_ref(), reason, who, now).in_bulk(bulk))
        .collect();
    let appended = match st.publisher.read().await.as_ref() {
        Some(p) => control::append_batch(p, &st.store.names, &recs).await,
        None => recs
            .iter()
            .map(|_| Err(fleet::Error::NotConnected))
            .collect(),
    };
    let mut marks = Vec::with_capacity(recs.len());
    let mut refused = Vec::new();
    for (rec, r) in recs.iter().zip(appended) {
        let control::Op::Cancel {
            task, reason, by, ..
        } = &rec.op
        else {
            continue;
        };
        match r {
            Ok(()) => marks.push((task.clone(), rec.at_ms, by.clone(), reason.clone())),
            Err(e) => refused.push((task.clone(), e)),
        }
    }
    let marks = st
        .store
        .cancel(Mode::Api, &marks, st.cfg.common.status_ttl)
        .await
        .map_err(|e| (marks.len() as u64, e));
    Appended { refused, marks }
}

/// Cancels `ids` in paced batches: per batch, the states read again (a task that ended or was
/// cancelled meanwhile is skipped), one control-stream record per task appended together
/// (confirms awaited: the promise), then the marks (`cancel.lua`, as the single cancel).
async fn cancel_all(
    st: &AppState,
    ids: &[String],
    who: &fleet::settings::Caller,
    reason: &str,
    bulk: &str,
) -> Tally {
    let mut t = Tally::default();
    let start = Instant::now();
    let mut done = 0;
    for batch in ids.chunks(BATCH) {
        pace(start, done).await;
        done += batch.len();
        let refs: Vec<&str> = batch.iter().map(String::as_str).collect();
        let states = match st.store.task_states(&refs).await {
            Ok(s) => s,
            Err(e) => {
                for id in batch {
                    t.fail(id, format!("cannot read its state: {e}"));
                }
                continue;
            }
        };
        let live: Vec<&String> = batch
            .iter()
            .zip(states)
            .filter_map(|(id, s)| match s {
                Some(s) if Action::Cancel.takes_word(&s) => Some(id),
                _ => None,
            })
            .collect();
        t.skipped += (batch.len() - live.len()) as u64;
        let now = st.store.clock.now_ms();
        let a = append_cancels(st, &live, who, reason, bulk, now).await;
        for (task, e) in a.refused {
            t.fail(
                &task,
                format!("the cancel was not recorded (nothing promised): {e}"),
            );
        }
        match a.marks {
            Ok(prev) => {
                for p in prev {
                    match p {
                        // This very record, applied first by a control loop (or the worker
                        // that ran the task ended it from the stream): see cancel.lua.
                        Some(p) if p.starts_with("same:") => t.applied += 1,
                        // Cancelled by someone else, or ended meanwhile.
                        Some(p) if TaskState::is_terminal_word(&p) => t.skipped += 1,
                        Some(_) => t.applied += 1,
                        None => t.skipped += 1,
                    }
                }
            }
            Err((n, e)) => {
                // The promise holds: every replica writes the marks from the stream.
                tracing::warn!(error = %e, n, "bulk cancel recorded in the control stream; its Redis marks follow from there");
                t.applied += n;
            }
        }
    }
    metrics::counter!(fleet::metrics::TASKS_CANCELLED).increment(t.applied);
    t
}

/// Appends a bulk action's audit record (a few tries, as `audit_log::audit_to`). Errors: the
/// broker did not take it.
async fn append_audit(st: &AppState, rec: &Record) -> fleet::Result<()> {
    let mut last = fleet::Error::NotConnected;
    for n in 0..3 {
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let r = match st.publisher.read().await.as_ref() {
            Some(p) => control::append(p, &st.store.names, rec).await,
            None => Err(fleet::Error::NotConnected),
        };
        match r {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
    }
    tracing::warn!(error = %last, "a bulk action's audit record was not written: nothing done");
    Err(last)
}

/// Replays (retry) or deletes the dead letters of the chosen ids, in one read of the dead
/// queue; a retry replays the cancelled ones from `<ns>.cancelled` the same way, in one read
/// of that queue.
async fn dead_letters(st: &AppState, action: Action, chosen: &Chosen) -> Result<Tally, Response> {
    let mut t = Tally::default();
    let ids = &chosen.ids;
    if ids.is_empty() {
        return Ok(t);
    }
    let Some(conn) = st.connection.read().await.clone() else {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_connected",
            "the scheduler is reconnecting to RabbitMQ",
        ));
    };
    let Ok(_permit) = st.dead_reader.acquire().await else {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "closed",
            "shutting down",
        ));
    };
    let busy =
        |e: fleet::Error| error(StatusCode::SERVICE_UNAVAILABLE, "dead_queue", e.to_string());
    match action {
        Action::Retry => {
            let limits = dead::ReplayLimits {
                max_bytes: st.cfg.common.limits.max_bytes,
                status_ttl: st.cfg.common.status_ttl,
            };
            // The cancelled ones from `<ns>.cancelled`, the others from `<ns>.dead`.
            let cancelled = TaskState::Cancelled.as_str();
            let (kept, dead_ids): (Vec<_>, Vec<_>) = ids
                .iter()
                .zip(&chosen.states)
                .partition(|(_, s)| s.as_str() == cancelled);
            let names = &st.store.names;
            for (queue, part) in [
                (names.dead_queue(), dead_ids),
                (names.cancelled_queue(), kept),
            ] {
                if part.is_empty() {
                    continue;
                }
                let part: Vec<String> = part.into_iter().map(|(id, _)| id.clone()).collect();
                let sel = Selection::ids(part.iter().cloned());
                let r =
                    match dead::replay_from(&conn, Some(&st.store), names, &queue, &sel, &limits)
                        .await
                    {
                        Ok(r) => r,
                        // Nothing done yet: the whole run is refused.
                        Err(e) if t.applied + t.skipped + t.failed == 0 => return Err(busy(e)),
                        // The dead letters were replayed: the answer says so, these failed.
                        Err(e) => {
                            for id in &part {
                                t.fail(id, format!("cannot read {queue}: {e}"));
                            }
                            continue;
                        }
                    };
                t.applied += r.replayed.len() as u64;
                t.skipped += r.missing.len() as u64;
                for (id, why) in r.failed {
                    t.fail(&id, why);
                }
            }
        }
        _ => {
            let sel = Selection::ids(ids.iter().cloned());
            let r = dead::delete(&conn, &st.store, &st.store.names, &sel)
                .await
                .map_err(busy)?;
            t.applied = r.deleted.len() as u64;
            t.skipped = r.missing.len() as u64;
        }
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn listing_queries_parse() {
        let (f, c, l) = parse_pairs(&pairs(&[
            ("state", "queued,parked"),
            ("state", "dead"),
            ("label", "zone=a"),
            ("kind", "k"),
            ("since", "1000"),
            ("until", "2026-12-01T00:00:00Z"),
            ("cursor", "17:t-1"),
            ("limit", "40"),
            ("group", ""),
        ]))
        .unwrap_or_default();
        assert_eq!(f.states, ["queued", "parked", "dead"]);
        assert_eq!(f.labels, ["zone=a"]);
        assert_eq!((f.kind.as_deref(), f.group.as_deref()), (Some("k"), None));
        assert_eq!(
            (f.since_ms, f.until_ms),
            (Some(1000), Some(1_796_083_200_000))
        );
        assert_eq!(c.map(|c| c.to_string()), Some("17:t-1".to_string()));
        assert_eq!(l, Some(40));
        assert!(parse_pairs(&pairs(&[("state", "nope")])).is_err());
        assert!(parse_pairs(&pairs(&[("since", "yesterday")])).is_err());
        assert!(parse_pairs(&pairs(&[("colour", "red")])).is_err());
    }

    #[test]
    fn bulk_bodies_parse() {
        let b = parse_bulk(
            br#"{"action":"cancel","query":{"kind":"k","state":["queued"]},"dry_run":true}"#,
        );
        let b = b.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(b.action, Action::Cancel);
        assert!(b.dry_run && b.ids.is_none() && b.limit == BULK_DEFAULT);
        assert_eq!(b.filter.map(|f| f.states), Some(vec!["queued".to_string()]));
        assert!(parse_bulk(br#"{"action":"retry","ids":["a"]}"#).is_ok());
        for bad in [
            &br#"{"action":"boom","ids":["a"]}"#[..],
            br#"{"action":"cancel"}"#,
            br#"{"action":"cancel","ids":[]}"#,
            br#"{"action":"cancel","ids":["a"],"query":{}}"#,
            br#"{"action":"cancel","query":{"cursor":"1:a"}}"#,
            br#"{"action":"cancel","ids":["a"],"limit":0}"#,
            b"[]",
        ] {
            assert!(parse_bulk(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(Action::Retry.takes_word("expired") && Action::Retry.takes_word("cancelled"));
        assert!(!Action::Delete.takes_word("cancelled"));
        assert!(Action::Cancel.takes_word("running") && !Action::Cancel.takes_word("succeeded"));
    }
}
