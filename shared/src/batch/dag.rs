//! Chains and DAGs inside a batch: a member may name `after: [ids]` (other members of the
//! same batch) and run only when every one of them has **succeeded**; it ends `dead` with
//! reason `dependency_failed` as soon as one of them ends otherwise (dead, expired, cancelled,
//! or dependency_failed itself: the failure cascades down the graph).
//!
//! # Where a dependent waits: in the batch's definition, not in a queue
//!
//! A member with `after` is **not published** at submission. Its envelope travels inside the
//! batch's definition record ([`crate::control::Op::BatchDef`], field `waiting`), appended to
//! the durable control stream before anything of the batch is published. Every scheduler
//! replica folds that record into its [`super::Batches`] board, so a dependent waits in
//! memory, durably backed by the stream: it holds no worker slot, sits in no broker queue and
//! is never redelivered or polled. Its parents' end records ([`crate::control::Op::BatchEnd`],
//! already appended by the workers for the batch's progress) are what the board waits for.
//!
//! When every parent succeeded, a replica's batch loop *releases* the dependent: it publishes
//! its envelope to the ingress with its own id (confirmed), then appends
//! [`crate::control::Op::BatchReleased`]. Two replicas releasing at once publish the same id:
//! the ingress dedupe drops the second copy, exactly as for the batch callbacks. When a parent
//! failed, a replica writes the dependent's status `dead` (reason `dependency_failed`) and
//! appends its end record, which the board folds like a worker's: its own dependents cascade
//! and the batch's `on_complete` counts it. A dependent never reaches the dead-letter queue
//! (there is nothing to replay without its parent). A cancel of a waiting dependent (the
//! control stream's `Cancel` record) ends it `cancelled` in the fold at once.
//!
//! # Validation: Kahn's algorithm
//!
//! [`check`] refuses a batch whose `after` links are not a DAG before anything is recorded:
//! an unknown or duplicate id, a self-reference, or a cycle. The cycle test is Kahn's
//! topological sort (repeatedly take the members whose parents are all taken); members left
//! over are on or behind a cycle, and walking parent links among them from any one of them
//! must come back to a member already walked: that loop is named in the error. O(members +
//! links).
//!
//! # `payload_from`: a parent's result in the child's payload
//!
//! A member may name one of its `after` ids in `payload_from`: when released, its payload gets
//! that parent's result under the key [`PARENT_RESULT`] (merged into an object payload; any
//! other payload is kept under `value`, as the callbacks' `batch` figures are). The result must
//! survive a Redis loss, so it travels in the parent's end record: [`check`] marks each parent
//! named in a `payload_from` with `pass_result: true`, and the worker that ends such a parent
//! `succeeded` puts its result in the end record when it is at most
//! [`crate::status::MAX_STATUS_TEXT`] bytes of JSON (a parent's end record written by a
//! scheduler's sweep reads the result from its Redis status). A child whose parent's result is
//! not known (larger than that, or lost with Redis before a sweep wrote the end record) ends
//! `dead` with `dependency_failed` and says why, rather than run without it.

use std::collections::{HashMap, HashSet, VecDeque};

use serde_json::{Map, Value};

/// The envelope field naming the members a task waits for.
pub const AFTER: &str = "after";
/// The envelope field naming the parent whose result goes into the payload.
pub const PAYLOAD_FROM: &str = "payload_from";
/// The envelope field (set by [`check`]) asking the worker to carry the task's result in its
/// end record.
pub const PASS_RESULT: &str = "pass_result";
/// The payload key under which a child gets its parent's result.
pub const PARENT_RESULT: &str = "parent_result";
/// Most bytes of waiting envelopes in one batch (they travel in one control-stream record).
pub const MAX_WAITING_BYTES: usize = 8 << 20;

/// Why a batch's `after` links were refused (→ 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DagError {
    /// `bad_after`, `unknown_dependency`, `self_dependency`, `duplicate_dependency`,
    /// `duplicate_id`, `bad_payload_from`, `cycle` or `too_large`.
    pub code: &'static str,
    /// What is wrong, for a human.
    pub detail: String,
    /// The offending member's index, when one is to blame.
    pub index: Option<usize>,
    /// For `cycle`: the ids around it, each to run before the next, the first repeated last.
    pub cycle: Vec<String>,
}

fn refuse(code: &'static str, index: Option<usize>, detail: String) -> DagError {
    DagError {
        code,
        detail,
        index,
        cycle: Vec::new(),
    }
}

/// A member's links: its `after` ids and its `payload_from`.
type Links = (Vec<String>, Option<String>);

/// A member's `after` ids and `payload_from` as written in its envelope; `Ok(None)` when it
/// has no (or an empty) `after`.
fn links(env: &Value) -> Result<Option<Links>, String> {
    let after = match env.get(AFTER) {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or("`after` must be an array of task ids (strings)")?,
        Some(_) => return Err("`after` must be an array of task ids (strings)".into()),
    };
    let from = match env.get(PAYLOAD_FROM) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err("`payload_from` must be a task id (a string)".into()),
    };
    if after.is_empty() {
        return match from {
            Some(_) => Err("`payload_from` needs `after` naming that task".into()),
            None => Ok(None),
        };
    }
    Ok(Some((after, from)))
}

/// Checks the `after` / `payload_from` links of a batch's members (`tasks`: envelopes whose
/// `id` is set) and marks each parent named in a `payload_from` with `pass_result: true`.
/// Returns the indexes of the members that wait (a non-empty `after`), in order; empty for a
/// batch without links (nothing is changed then).
///
/// # Errors
/// [`DagError`]: `after` not an array of strings; an id that is not a member
/// (`unknown_dependency`), the member itself, named twice; two members with the same id in a
/// batch with links; `payload_from` not one of its `after` ids; the links make a cycle
/// (Kahn's algorithm; the cycle's ids are named); the waiting envelopes over
/// [`MAX_WAITING_BYTES`].
pub fn check(tasks: &mut [Value]) -> Result<Vec<usize>, DagError> {
    let mut parsed = Vec::with_capacity(tasks.len());
    for (i, t) in tasks.iter().enumerate() {
        parsed.push(links(t).map_err(|d| refuse("bad_after", Some(i), d))?);
    }
    let waiting: Vec<usize> = (0..tasks.len()).filter(|&i| parsed[i].is_some()).collect();
    if waiting.is_empty() {
        return Ok(waiting);
    }
    let ids: Vec<String> = tasks
        .iter()
        .map(|t| {
            t.get("id")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        })
        .collect();
    let mut index: HashMap<&str, usize> = HashMap::with_capacity(ids.len());
    for (i, id) in ids.iter().enumerate() {
        if index.insert(id.as_str(), i).is_some() {
            return Err(refuse(
                "duplicate_id",
                Some(i),
                format!("task id `{id}` appears twice in a batch with `after` links"),
            ));
        }
    }
    // parents[i]: the indexes member i waits for.
    let mut parents: Vec<Vec<usize>> = vec![Vec::new(); tasks.len()];
    let mut pass = HashSet::new();
    for &i in &waiting {
        let Some((after, from)) = &parsed[i] else {
            continue;
        };
        let mut seen = HashSet::new();
        for a in after {
            let Some(&p) = index.get(a.as_str()) else {
                return Err(refuse(
                    "unknown_dependency",
                    Some(i),
                    format!("`after` names `{a}`, which is not a task of this batch"),
                ));
            };
            if p == i {
                return Err(refuse(
                    "self_dependency",
                    Some(i),
                    format!("task `{a}` names itself in `after`"),
                ));
            }
            if !seen.insert(p) {
                return Err(refuse(
                    "duplicate_dependency",
                    Some(i),
                    format!("`after` names `{a}` twice"),
                ));
            }
            parents[i].push(p);
        }
        if let Some(f) = from {
            if !after.contains(f) {
                return Err(refuse(
                    "bad_payload_from",
                    Some(i),
                    format!("`payload_from` names `{f}`, which is not one of its `after` ids"),
                ));
            }
            pass.insert(index[f.as_str()]);
        }
    }
    if let Some(cycle) = find_cycle(&parents) {
        let names: Vec<String> = cycle.iter().map(|&i| ids[i].clone()).collect();
        return Err(DagError {
            code: "cycle",
            detail: format!(
                "the `after` links make a cycle: {} (each would have to run before the next)",
                names.join(" → ")
            ),
            index: cycle.first().copied(),
            cycle: names,
        });
    }
    let bytes: usize = waiting
        .iter()
        .map(|&i| serde_json::to_vec(&tasks[i]).map_or(0, |b| b.len()))
        .sum();
    if bytes > MAX_WAITING_BYTES {
        return Err(refuse(
            "too_large",
            None,
            format!("the waiting tasks hold {bytes} bytes; a batch holds at most {MAX_WAITING_BYTES} bytes of tasks with `after`"),
        ));
    }
    for p in pass {
        if let Some(o) = tasks[p].as_object_mut() {
            o.insert(PASS_RESULT.into(), Value::Bool(true));
        }
    }
    Ok(waiting)
}

/// Kahn's algorithm over `parents` (member → the members it waits for): `None` when every
/// member can be ordered, else one cycle as indexes, each to run before the next, the first
/// repeated at the end.
fn find_cycle(parents: &[Vec<usize>]) -> Option<Vec<usize>> {
    let n = parents.len();
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut indegree: Vec<usize> = vec![0; n];
    for (c, ps) in parents.iter().enumerate() {
        indegree[c] = ps.len();
        for &p in ps {
            children[p].push(c);
        }
    }
    let mut ready: VecDeque<usize> = (0..n).filter(|&i| indegree[i] == 0).collect();
    let mut taken = 0;
    while let Some(i) = ready.pop_front() {
        taken += 1;
        for &c in &children[i] {
            indegree[c] -= 1;
            if indegree[c] == 0 {
                ready.push_back(c);
            }
        }
    }
    if taken == n {
        return None;
    }
    // Every member left has a parent left (else it would have been taken): walk up from one
    // until a member repeats.
    let start = (0..n).find(|&i| indegree[i] > 0)?;
    let mut walk = vec![start];
    let mut at: HashMap<usize, usize> = HashMap::from([(start, 0)]);
    let mut cur = start;
    loop {
        let next = *parents[cur].iter().find(|&&p| indegree[p] > 0)?;
        if let Some(&k) = at.get(&next) {
            // Walked child → parent: reversed, each runs before the next; rotated so the
            // member first met on the loop comes first.
            let mut cycle: Vec<usize> = walk[k..].to_vec();
            cycle.reverse();
            cycle.rotate_right(1);
            cycle.push(cycle[0]);
            return Some(cycle);
        }
        at.insert(next, walk.len());
        walk.push(next);
        cur = next;
    }
}

/// A waiting member as folded from its batch's definition.
#[derive(Debug, Clone)]
pub(super) struct Dep {
    /// Its envelope as submitted (with `submitted_at` stamped).
    pub envelope: Value,
    /// The members it waits for.
    pub after: Vec<String>,
    /// The parent whose result goes into its payload.
    pub payload_from: Option<String>,
}

impl Dep {
    /// The waiting member of envelope `env`: `(id, dep)`; `None` for an envelope without an
    /// id or without `after` (not one [`check`] accepted).
    pub(super) fn of(env: &Value) -> Option<(String, Dep)> {
        let id = env.get("id")?.as_str()?.to_string();
        let (after, payload_from) = links(env).ok()??;
        Some((
            id,
            Dep {
                envelope: env.clone(),
                after,
                payload_from,
            },
        ))
    }
}

/// What a replica's batch loop does next for a waiting member ([`super::Batches::steps`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Every parent succeeded: publish `envelope` (its `payload_from` result merged in).
    Release {
        /// The batch id.
        batch: String,
        /// The member id.
        task: String,
        /// The envelope to publish.
        envelope: Value,
    },
    /// A parent ended otherwise (or its result for `payload_from` is not known): the member
    /// ends `dead`, reason `dependency_failed`, with `detail`.
    Fail {
        /// The batch id.
        batch: String,
        /// The member id.
        task: String,
        /// Its lane (`normal` when it names none).
        lane: String,
        /// Why, for a human: which parent ended how.
        detail: String,
    },
}

/// The envelope `env` with `result` under [`PARENT_RESULT`] in its payload (merged into an
/// object payload; absent or `null` payload: a new object; any other payload is kept under
/// `value`).
pub fn with_parent_result(env: &Value, result: &Value) -> Value {
    let mut out = env.as_object().cloned().unwrap_or_default();
    let mut payload = match out.remove("payload") {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => Map::new(),
        Some(v) => Map::from_iter([("value".to_string(), v)]),
    };
    payload.insert(PARENT_RESULT.into(), result.clone());
    out.insert("payload".into(), Value::Object(payload));
    Value::Object(out)
}

/// The result a worker puts in a member's end record: `text` (the handler's JSON result) when
/// the envelope asks for it (`pass_result`) and it is at most
/// [`crate::status::MAX_STATUS_TEXT`] bytes of valid JSON; `None` otherwise.
pub fn passed_result(env: &crate::Envelope, text: &str) -> Option<Value> {
    let asked = env.extra.get(PASS_RESULT).and_then(Value::as_bool) == Some(true);
    if !asked || text.len() > crate::status::MAX_STATUS_TEXT {
        return None;
    }
    serde_json::from_str(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn t(id: &str, after: &[&str]) -> Value {
        json!({"id": id, "kind": "k", "after": after})
    }

    #[test]
    fn a_diamond_is_accepted_and_a_payload_from_parent_marked() {
        let mut tasks = vec![
            json!({"id": "a", "kind": "k"}),
            t("b", &["a"]),
            t("c", &["a"]),
            json!({"id": "d", "kind": "k", "after": ["b", "c"], "payload_from": "c"}),
        ];
        assert_eq!(check(&mut tasks).unwrap(), vec![1, 2, 3]);
        assert_eq!(tasks[2][PASS_RESULT], true);
        assert!(tasks[1].get(PASS_RESULT).is_none());
    }

    #[test]
    fn a_cycle_is_named() {
        let mut tasks = vec![
            json!({"id": "x", "kind": "k"}),
            t("a", &["c"]),
            t("b", &["a"]),
            t("c", &["b"]),
            t("d", &["c"]),
        ];
        let e = check(&mut tasks).unwrap_err();
        assert_eq!(e.code, "cycle");
        assert_eq!(e.cycle.len(), 4);
        assert_eq!(e.cycle.first(), e.cycle.last());
        // Each runs before the next, from the first member met: a → b → c → a.
        assert_eq!(e.cycle, vec!["a", "b", "c", "a"]);
        assert_eq!(e.index, Some(1));
        assert_eq!(
            e.detail,
            "the `after` links make a cycle: a → b → c → a (each would have to run before the next)"
        );
        assert!(e.detail.contains("→"), "{}", e.detail);
    }

    #[test]
    fn bad_links_are_refused() {
        for (tasks, code) in [
            (vec![t("a", &["zz"])], "unknown_dependency"),
            (vec![t("a", &["a"])], "self_dependency"),
            (
                vec![json!({"id": "p", "kind": "k"}), t("a", &["p", "p"])],
                "duplicate_dependency",
            ),
            (
                vec![json!({"id": "p", "kind": "k"}), t("p", &["p"])],
                "duplicate_id",
            ),
            (
                vec![
                    json!({"id": "p", "kind": "k"}),
                    json!({"id": "q", "kind": "k"}),
                    json!({"id": "a", "kind": "k", "after": ["p"], "payload_from": "q"}),
                ],
                "bad_payload_from",
            ),
            (
                vec![json!({"id": "a", "kind": "k", "after": "p"})],
                "bad_after",
            ),
        ] {
            let mut tasks = tasks;
            assert_eq!(check(&mut tasks).unwrap_err().code, code);
        }
        let mut plain = vec![json!({"id": "a", "kind": "k"})];
        assert!(check(&mut plain).unwrap().is_empty());
    }

    #[test]
    fn the_parent_result_is_merged_into_the_payload() {
        let env = json!({"id": "c", "kind": "k", "payload": {"n": 1}});
        let out = with_parent_result(&env, &json!({"sum": 3}));
        assert_eq!(out["payload"], json!({"n": 1, "parent_result": {"sum": 3}}));
        let out = with_parent_result(&json!({"id": "c", "kind": "k", "payload": 5}), &json!(2));
        assert_eq!(out["payload"], json!({"value": 5, "parent_result": 2}));
    }
}
