//! A batch's definition ([`fleet::batch`]) built from a request, the same for both ways of
//! making one: `POST /v1/batches` ([`crate::api`], [`Form::Api`]) and the AMQP closing message
//! ([`crate::batch_close`], [`Form::Close`]).
//!
//! [`define`] checks the whole request and builds the `BatchDef` record (nothing is recorded
//! or published by it); [`commit`] appends the record to the durable control stream
//! (publisher-confirmed), folds it into this replica's board and writes the waiting members'
//! statuses. A batch this replica already knows (its definition read or appended) is not
//! appended again: the fold keeps the first definition anyway.
//!
//! The request body, in both forms: `{"id": string, "tasks": [...], "on_success"?: envelope,
//! "on_complete"?: envelope}`.
//!
//! * [`Form::Api`]: `id` optional (generated when absent); every task is an envelope (its `id`
//!   generated when absent), stamped with `batch`. The members without `after` are for the
//!   caller to publish ([`Definition::publish`]).
//! * [`Form::Close`]: `id` required (the members, already published, carry it in their
//!   `batch` field); a task is either a **member id** (a string: a member published before
//!   the close) or a **waiting envelope** — one with a non-empty `after`, not published by the
//!   producer, held in the definition and released by the batch loop when its parents
//!   succeeded. An envelope without `after` is refused (publish it as a task and list its id).

use chrono::{DateTime, SecondsFormat, Utc};
use fleet::task::Limits;
use serde_json::{json, Map, Value};

/// Which request a definition comes from (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `POST /v1/batches`: every task an envelope, published by the API.
    Api,
    /// The AMQP closing message: member ids (already published) and waiting envelopes.
    Close,
}

/// Why a request was refused: `POST /v1/batches` answers 400 with it; a close is
/// dead-lettered with reason `bad_batch` and it as the detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// A bounded word: `bad_body`, `bad_batch_id`, `no_tasks`, `too_many_tasks`,
    /// `bad_callback`, `bad_envelope`, `bad_member_id`, `not_waiting`, a
    /// [`fleet::batch::dag::DagError`] code (`cycle`, `unknown_dependency`...) or an
    /// envelope's refusal code (`missing_kind`, `bad_field`...).
    pub code: &'static str,
    /// What is wrong, for a human.
    pub detail: String,
    /// The offending task's index in `tasks`; `-1` for a callback or the request as a whole.
    pub index: i64,
    /// For `cycle`: the ids around it (the first repeated last); empty otherwise.
    pub cycle: Vec<String>,
}

impl Refusal {
    fn new(code: &'static str, index: i64, detail: impl Into<String>) -> Self {
        Refusal {
            code,
            detail: detail.into(),
            index,
            cycle: Vec::new(),
        }
    }

    /// The JSON of a 400 answer: `{"error", "detail", "index", "cycle"?}`.
    pub fn to_json(&self) -> Value {
        let mut body = json!({"error": self.code, "detail": self.detail, "index": self.index});
        if !self.cycle.is_empty() {
            body["cycle"] = json!(self.cycle);
        }
        body
    }

    /// One line for a dead letter's detail: `<code>: <detail>`, then ` (task <index>)` when
    /// one task is to blame (a cycle's detail spells it: `a → b → a`).
    pub fn line(&self) -> String {
        let mut s = format!("{}: {}", self.code, self.detail);
        if self.index >= 0 {
            s.push_str(&format!(" (task {})", self.index));
        }
        s
    }
}

/// What a definition is checked with.
#[derive(Debug, Clone)]
pub struct Ctx<'a> {
    /// The envelope limits (`FLEET_MAX_*`).
    pub limits: &'a Limits,
    /// `max_attempts` of an envelope without one.
    pub default_max_attempts: u32,
    /// Now (the store's clock): a waiting member's `submitted_at` when it has none.
    pub now: DateTime<Utc>,
    /// Now in Unix ms (the record's time).
    pub now_ms: i64,
    /// The fairness key the submitter's token is bound to ([`Form::Api`] only).
    pub key: Option<&'a str>,
}

/// A checked batch, not yet recorded.
#[derive(Debug)]
pub struct Definition {
    /// The batch id.
    pub batch: String,
    /// Every member id, in request order.
    pub ids: Vec<String>,
    /// The ids of the members that wait (`after`), in request order.
    pub waiting: Vec<String>,
    /// [`Form::Api`]: the members to publish now (a JSON array of envelopes, each with `id`
    /// and `batch`), `None` when every member waits; always `None` for [`Form::Close`].
    pub publish: Option<Vec<u8>>,
    /// The `BatchDef` record to append.
    pub record: fleet::control::Record,
    /// The waiting members' statuses (`waiting`, with `after`, and what each task is).
    pub statuses: fleet::status::Writes,
}

/// Checks `body` and builds its batch's definition.
///
/// # Errors
/// [`Refusal`], before anything is recorded: not a JSON object (`bad_body`); a bad or (for a
/// close) missing `id` (`bad_batch_id`: 1 to 128 bytes, no control characters); `tasks` not a
/// non-empty array (`no_tasks`) or over [`fleet::batch::MAX_TASKS`] (`too_many_tasks`); a
/// callback that is not an envelope with a string `kind`, or one the envelope checks refuse
/// (`bad_callback` or its code, index `-1`); a task that is no envelope (`bad_envelope`), or
/// for a close no member id either (`bad_member_id`: an id of 1 to `max_id_bytes` bytes
/// without control characters) or an envelope that does not wait (`not_waiting`); the `after`
/// links' refusals ([`fleet::batch::dag::check`]: `cycle` with the ids around it,
/// `unknown_dependency`...); an envelope the ingress would refuse (its code, its index).
pub fn define(body: &[u8], form: Form, ctx: &Ctx<'_>) -> Result<Definition, Refusal> {
    let mut req = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => {
            return Err(Refusal::new(
                "bad_body",
                -1,
                "the body must be a JSON object",
            ))
        }
        Err(e) => return Err(Refusal::new("bad_body", -1, format!("malformed JSON: {e}"))),
    };
    let batch = match req.remove("id") {
        None | Some(Value::Null) if form == Form::Api => fleet::control::new_id(),
        Some(Value::String(s))
            if !s.is_empty() && s.len() <= 128 && !s.chars().any(char::is_control) =>
        {
            s
        }
        _ => {
            return Err(Refusal::new(
                "bad_batch_id",
                -1,
                match form {
                    Form::Api => "`id` must be a string of 1 to 128 bytes without control characters",
                    Form::Close => "`id` (the batch id its members carry in `batch`) must be a string of 1 to 128 bytes without control characters",
                },
            ))
        }
    };
    let mut tasks = match req.remove("tasks") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => {
            return Err(Refusal::new(
                "no_tasks",
                -1,
                match form {
                    Form::Api => "`tasks` must be a non-empty array of envelopes",
                    Form::Close => "`tasks` must be a non-empty array of member ids (strings) and waiting envelopes",
                },
            ))
        }
    };
    if tasks.len() > fleet::batch::MAX_TASKS {
        return Err(Refusal::new(
            "too_many_tasks",
            -1,
            format!(
                "a batch holds at most {} tasks ({} given)",
                fleet::batch::MAX_TASKS,
                tasks.len()
            ),
        ));
    }
    let callbacks = callbacks(&mut req)?;
    // Every member's id; `envelopes[i]`: whether task i is an envelope (else a member id,
    // replaced by a stub `{"id": id}` for the `after` check).
    let mut ids = Vec::with_capacity(tasks.len());
    let mut envelopes = Vec::with_capacity(tasks.len());
    for (i, t) in tasks.iter_mut().enumerate() {
        match t {
            Value::Object(o) => {
                let id = match o.get("id") {
                    Some(Value::String(s)) => s.clone(),
                    _ => {
                        let id = uuid::Uuid::new_v4().to_string();
                        o.insert("id".into(), Value::String(id.clone()));
                        id
                    }
                };
                o.insert("batch".into(), Value::String(batch.clone()));
                ids.push(id);
                envelopes.push(true);
            }
            Value::String(s) if form == Form::Close => {
                if s.is_empty()
                    || s.len() > ctx.limits.max_id_bytes
                    || s.chars().any(char::is_control)
                {
                    return Err(Refusal::new(
                        "bad_member_id",
                        i as i64,
                        format!(
                            "a member id must be a string of 1 to {} bytes without control characters",
                            ctx.limits.max_id_bytes
                        ),
                    ));
                }
                ids.push(s.clone());
                *t = json!({ "id": s });
                envelopes.push(false);
            }
            _ => {
                return Err(Refusal::new(
                    "bad_envelope",
                    i as i64,
                    match form {
                        Form::Api => "a task must be a JSON object",
                        Form::Close => "a task must be a member id (a string) or a waiting envelope (a JSON object with `after`)",
                    },
                ))
            }
        }
    }
    let waiting = fleet::batch::dag::check(&mut tasks).map_err(|e| Refusal {
        code: e.code,
        detail: e.detail,
        index: e.index.map_or(-1, |i| i as i64),
        cycle: e.cycle,
    })?;
    let mut waits = vec![false; tasks.len()];
    for &i in &waiting {
        waits[i] = true;
    }
    if form == Form::Close {
        if let Some(i) = (0..tasks.len()).find(|&i| envelopes[i] && !waits[i]) {
            return Err(Refusal::new(
                "not_waiting",
                i as i64,
                "an envelope in a close must wait for other members (a non-empty `after`); publish the others as tasks (with `batch`) and list their ids",
            ));
        }
    }
    // Every envelope checked as the ingress would (an invalid one refuses the whole batch);
    // `at[k]`: the task index of the k-th envelope.
    let at: Vec<usize> = (0..tasks.len()).filter(|&i| envelopes[i]).collect();
    let mut parsed = Vec::new();
    if !at.is_empty() {
        let objects: Vec<&Value> = at.iter().map(|&i| &tasks[i]).collect();
        let bytes = serde_json::to_vec(&objects)
            .map_err(|e| Refusal::new("bad_body", -1, e.to_string()))?;
        let index_of = |k: Option<usize>| k.map_or(-1, |k| at[k] as i64);
        parsed = fleet::task::parse_body(&bytes, ctx.limits, ctx.default_max_attempts, ctx.now)
            .map_err(|b| Refusal::new(b.code, index_of(b.index), b.detail))?;
        // The waiting members are published later by a batch loop, not by `submit`: they get
        // what `submit` would give them now — the token's fairness key.
        if let Some(k) = ctx.key {
            fleet::task::bind_key(&mut parsed, k, ctx.limits)
                .map_err(|b| Refusal::new(b.code, index_of(b.index), b.detail))?;
        }
    }
    // The waiting envelopes, with `submitted_at` stamped (their deadline counts from the
    // batch's definition), and their statuses.
    let mut held = Vec::with_capacity(waiting.len());
    let mut statuses = fleet::status::Writes::new();
    for (p, &i) in parsed.iter().zip(&at) {
        if !waits[i] {
            continue;
        }
        let Ok(Value::Object(mut env)) = serde_json::from_str::<Value>(p.raw.get()) else {
            return Err(Refusal::new(
                "bad_envelope",
                i as i64,
                "a task must be a JSON object",
            ));
        };
        if p.stamped {
            env.insert(
                "submitted_at".into(),
                Value::String(ctx.now.to_rfc3339_opts(SecondsFormat::Micros, true)),
            );
        }
        let after: Vec<String> = env
            .get(fleet::batch::dag::AFTER)
            .and_then(|a| serde_json::from_value(a.clone()).ok())
            .unwrap_or_default();
        let e = &p.envelope;
        statuses.waiting(&e.id, e.lane, &after, &batch);
        statuses.describe(
            &e.id,
            &e.kind,
            &e.selector().pairs().join(","),
            e.submitted_at,
        );
        held.push(Value::Object(env));
    }
    check_callbacks(&callbacks, &batch, ids.len(), ctx)?;
    let publish = match form {
        Form::Close => None,
        Form::Api => {
            let now_tasks: Vec<&Value> = tasks
                .iter()
                .zip(&waits)
                .filter(|(_, w)| !**w)
                .map(|(t, _)| t)
                .collect();
            if now_tasks.is_empty() {
                None
            } else {
                Some(
                    serde_json::to_vec(&now_tasks)
                        .map_err(|e| Refusal::new("bad_body", -1, e.to_string()))?,
                )
            }
        }
    };
    let waiting_ids = waiting.iter().map(|&i| ids[i].clone()).collect();
    let [on_success, on_complete] = callbacks;
    let record = fleet::batch::def_record(
        &batch,
        ids.clone(),
        (on_success, on_complete),
        held,
        ctx.now_ms,
    );
    Ok(Definition {
        batch,
        ids,
        waiting: waiting_ids,
        publish,
        record,
        statuses,
    })
}

/// Takes `on_success` / `on_complete` out of the request: each absent, null, or an object
/// with a string `kind`.
fn callbacks(req: &mut Map<String, Value>) -> Result<[Option<Value>; 2], Refusal> {
    let mut out = [None, None];
    for (slot, name) in out.iter_mut().zip(fleet::batch::CALLBACKS) {
        match req.remove(name) {
            None | Some(Value::Null) => {}
            Some(Value::Object(o)) if o.get("kind").is_some_and(Value::is_string) => {
                *slot = Some(Value::Object(o))
            }
            Some(_) => {
                return Err(Refusal::new(
                    "bad_callback",
                    -1,
                    format!("`{name}` must be an envelope (an object with a string `kind`)"),
                ))
            }
        }
    }
    Ok(out)
}

/// Checks each callback as it will be published (with its id and the batch's figures).
fn check_callbacks(
    callbacks: &[Option<Value>; 2],
    batch: &str,
    total: usize,
    ctx: &Ctx<'_>,
) -> Result<(), Refusal> {
    for (name, cb) in fleet::batch::CALLBACKS.iter().zip(callbacks) {
        let Some(cb) = cb else { continue };
        let probe = fleet::batch::Progress {
            id: batch.to_string(),
            total,
            succeeded: 0,
            dead: 0,
            expired: 0,
            cancelled: 0,
            pending: total,
            failed: Vec::new(),
            fired: Vec::new(),
            callbacks: Vec::new(),
            waiting: Vec::new(),
            complete: false,
            at_ms: 0,
            cancel: None,
        };
        let env = fleet::batch::callback_envelope(cb, name, &probe);
        let bytes = serde_json::to_vec(&env).unwrap_or_default();
        if let Err(b) =
            fleet::task::parse_body(&bytes, ctx.limits, ctx.default_max_attempts, ctx.now)
        {
            return Err(Refusal::new(b.code, -1, format!("`{name}`: {}", b.detail)));
        }
    }
    Ok(())
}

/// Why `def` cannot be recorded although it is valid: its batch id is defined already with
/// other members (a reused id — the first definition stands, and the new members would never
/// count); `None` when the id is new or defined with the same members (a repeat: nothing to do).
pub fn conflict(def: &Definition, batches: &fleet::batch::Batches) -> Option<String> {
    let known = batches.members(&def.batch)?;
    (known != def.ids).then(|| {
        format!(
            "batch `{}` is defined already with {} other members (a batch id names one batch for the control stream's retention: pick a new id)",
            def.batch,
            known.len()
        )
    })
}

/// Records `def`: appends its `BatchDef` record to the control stream on `publisher`
/// (publisher-confirmed), writes the waiting members' statuses (a cache of the definition: a
/// failure is logged, not returned) and folds the record into `batches`. A batch `batches` already
/// holds is not appended again (its definition is durable already; the fold keeps the first
/// one). Returns `true` when the batch was new to this replica.
///
/// # Errors
/// The record was not confirmed (or no publisher): nothing is promised, try again.
pub async fn commit(
    def: &Definition,
    publisher: Option<&fleet::broker::amqp::Publisher>,
    store: &fleet::Store,
    batches: &fleet::batch::Batches,
    status_ttl: std::time::Duration,
) -> fleet::Result<bool> {
    if batches.progress(&def.batch).is_some() {
        return Ok(false);
    }
    let p = publisher.ok_or(fleet::Error::NotConnected)?;
    fleet::control::append(p, &store.names, &def.record).await?;
    // The waiting members' statuses, before this replica's batch loop can release one: through
    // the API before any parent is published; from a close, whose members may all have ended
    // already, before the fold below wakes the loop (so `waiting` is not written over a
    // released member's state — only the control loop reading the record back first could).
    if !def.statuses.is_empty() {
        if let Err(e) = store.write_statuses(&def.statuses, status_ttl).await {
            tracing::warn!(error = %e, batch = %def.batch, "cannot write the waiting members' statuses");
        }
    }
    // This replica knows it at once (its control loop reads the record too: idempotent).
    batches.apply(&def.record);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(limits: &Limits) -> Ctx<'_> {
        Ctx {
            limits,
            default_max_attempts: 3,
            now: Utc::now(),
            now_ms: 0,
            key: None,
        }
    }

    fn close(body: Value) -> Result<Definition, Refusal> {
        define(
            &serde_json::to_vec(&body).unwrap(),
            Form::Close,
            &ctx(&Limits::default()),
        )
    }

    /// A close lists member ids and waiting envelopes; only the envelopes travel in the
    /// record, nothing is to be published.
    #[test]
    fn a_close_holds_ids_and_waiting_envelopes() {
        let d = close(json!({"id": "b1", "tasks": ["a", "b",
            {"id": "c", "kind": "k", "after": ["a", "b"]}],
            "on_complete": {"kind": "done"}}))
        .unwrap();
        assert_eq!(d.batch, "b1");
        assert_eq!(d.ids, ["a", "b", "c"]);
        assert_eq!(d.waiting, ["c"]);
        assert!(d.publish.is_none());
        let fleet::control::Op::BatchDef {
            tasks,
            waiting,
            on_complete,
            ..
        } = &d.record.op
        else {
            panic!("not a BatchDef: {:?}", d.record.op);
        };
        assert_eq!(tasks, &["a", "b", "c"]);
        assert_eq!(waiting.len(), 1);
        assert_eq!(waiting[0]["batch"], "b1");
        assert!(on_complete.is_some());
    }

    /// Every way a close is refused, with its code and the task's index.
    #[test]
    fn bad_closes_are_refused_with_a_code() {
        let too_many: Vec<String> = (0..=fleet::batch::MAX_TASKS)
            .map(|i| i.to_string())
            .collect();
        let rows = [
            (json!([1]), "bad_body", -1),
            (json!({"tasks": ["a"]}), "bad_batch_id", -1),
            (json!({"id": "", "tasks": ["a"]}), "bad_batch_id", -1),
            (json!({"id": "b", "tasks": []}), "no_tasks", -1),
            (json!({"id": "b", "tasks": too_many}), "too_many_tasks", -1),
            (json!({"id": "b", "tasks": ["a", 7]}), "bad_envelope", 1),
            (json!({"id": "b", "tasks": ["a", ""]}), "bad_member_id", 1),
            (
                json!({"id": "b", "tasks": ["a"], "on_success": {"payload": 1}}),
                "bad_callback",
                -1,
            ),
            (
                json!({"id": "b", "tasks": ["a", {"kind": "k"}]}),
                "not_waiting",
                1,
            ),
            (
                json!({"id": "b", "tasks": ["a", {"kind": "k", "after": ["z"]}]}),
                "unknown_dependency",
                1,
            ),
            (
                json!({"id": "b", "tasks": ["a", {"id": "x", "kind": "k", "after": ["y"]},
                    {"id": "y", "kind": "k", "after": ["x"]}]}),
                "cycle",
                1,
            ),
            (
                json!({"id": "b", "tasks": ["a", {"id": "x", "after": ["a"]}]}),
                "missing_kind",
                1,
            ),
        ];
        for (body, code, index) in rows {
            let e = close(body.clone()).unwrap_err();
            assert_eq!((e.code, e.index), (code, index), "{body}: {e:?}");
        }
        let e = close(
            json!({"id": "b", "tasks": ["a", {"id": "x", "kind": "k", "after": ["y"]},
            {"id": "y", "kind": "k", "after": ["x"]}]}),
        )
        .unwrap_err();
        assert!(e.line().contains("cycle"), "{}", e.line());
        assert!(!e.cycle.is_empty());
    }

    /// The API form: ids generated, members without `after` to publish (with `batch`).
    #[test]
    fn the_api_form_publishes_the_members_that_do_not_wait() {
        let l = Limits::default();
        let body = json!({"tasks": [{"kind": "a"}, {"id": "x", "kind": "b"},
            {"id": "y", "kind": "c", "after": ["x"]}]});
        let d = define(&serde_json::to_vec(&body).unwrap(), Form::Api, &ctx(&l)).unwrap();
        assert_eq!(d.ids.len(), 3);
        assert_eq!(d.waiting, ["y"]);
        let now: Vec<Value> = serde_json::from_slice(&d.publish.unwrap()).unwrap();
        assert_eq!(now.len(), 2);
        assert!(now.iter().all(|t| t["batch"] == json!(d.batch)));
        // A string member is a close's only.
        let body = json!({"tasks": ["a"]});
        let e = define(&serde_json::to_vec(&body).unwrap(), Form::Api, &ctx(&l)).unwrap_err();
        assert_eq!((e.code, e.index), ("bad_envelope", 0));
    }
}
