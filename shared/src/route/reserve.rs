//! Reserving room for a batch of tasks: the Rust side of `reserve.lua` (beside this file), the
//! one script that dedupes ([`crate::route`]), chooses a group ([`super`]) and reserves a
//! leased slot there — or names the group to park behind ([`crate::route::park`]) — for every task of
//! a dispatch batch, atomically.

use deadpool_redis::redis;

use super::Reservation;
use crate::error::Result;
use crate::redis::Store;
use crate::route::Dedupe;
use crate::task::Labels;
use crate::task::Lane;
use crate::task::Strategy;

/// One task to route.
#[derive(Debug, Clone)]
pub struct ReserveRequest {
    /// The task id (the dedupe key).
    pub id: String,
    /// Its lane: the group lane reserved in.
    pub lane: Lane,
    /// The labels a group must hold ([`crate::Envelope::selector`]).
    pub selector: Labels,
    /// The task's kind: only a group whose every active worker handles it is a candidate
    /// (see [`crate::registry::Kinds`]).
    pub kind: String,
    /// The task's own strategy, over the batch's [`ReserveParams::strategy`].
    pub strategy: Option<Strategy>,
    /// How its id is checked against the dedupe window.
    pub dedupe: Dedupe,
    /// Released from a park queue: may take room even while the group has parked tasks.
    pub from_park: bool,
    /// Dedupe only, no routing (a delayed submission, routed when it is due): the answer is
    /// [`Reservation::Fresh`] or [`Reservation::Duplicate`].
    pub dedupe_only: bool,
    /// The task's fairness key (`None`: the shared default, never limited): counted against
    /// its limits ([`KeyArg`]), parked in a fair queue when it waits.
    pub key: Option<String>,
}

/// What the reservation is told of one fairness key of a batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KeyArg {
    /// Running + reserved never above it (`None`: no limit).
    pub max_running: Option<u32>,
    /// Token bucket (tasks per second, burst), `None`: no rate limit.
    pub rate: Option<(f64, u32)>,
    /// Paused: its tasks wait.
    pub paused: bool,
}

/// The answers of a keyed reservation call ([`Store::reserve_keyed`]).
#[derive(Debug, Clone, Default)]
pub struct Reserved {
    /// One answer per request, in order.
    pub answers: Vec<Reservation>,
    /// Key slots whose lease had lapsed, dropped by this call (leaked by a crash: counted in
    /// `fleet_key_slots_reclaimed_total`).
    pub reclaimed: u64,
    /// Per key of the batch: its running + reserved after the call (`None`: not read), and
    /// whether a task of it was held back by the key itself (paused, at its limit, no token).
    pub used: Vec<(String, Option<u32>, bool)>,
}

/// What a task is, written into its status record by the same `reserve.lua` call that
/// writes its state (queued or parked): no Redis command of its own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskDescription {
    /// The envelope's `kind`.
    pub kind: String,
    /// When the task was submitted (Unix ms; `None`: unknown).
    pub submitted_at_ms: Option<i64>,
}

/// Parameters of routing common to a batch.
#[derive(Debug, Clone, Copy)]
pub struct ReserveParams {
    /// Lease of a reservation (ms): an unstarted reservation stops counting after it.
    pub lease_ms: i64,
    /// Dispatch beyond capacity, as a fraction: a group has room while
    /// `running + reserved < capacity × (1 + backlog_factor)`.
    pub backlog_factor: f64,
    /// How a group is chosen among those that match, unless a task names its own.
    pub strategy: Strategy,
    /// How long a task id is remembered to drop duplicates (ms).
    pub dedupe_window_ms: i64,
    /// How long the status records written here live (ms).
    pub status_ttl_ms: i64,
    /// Names this batch's dedupe marks (`p:<token>`): a retry of the same batch with the same
    /// token never takes its own marks for duplicates. New for every batch; reused by retries.
    pub token: u64,
    /// Direct dispatch: a normal-lane task that only one live group can take is reserved there even
    /// beyond the group's room (no routing choice to protect; the group's consumers' prefetch
    /// bounds what they hold), unless tasks already park for that group. The scheduler sets
    /// it; `false` makes every task need room (the script's bound alone).
    pub direct: bool,
    /// How long a group's "has parked tasks" flag lives unless renewed (ms): set here when a
    /// task parks, kept alive by the scheduler's park loop while it holds tasks.
    pub park_flag_ttl_ms: i64,
}

impl Store {
    /// Routes and reserves a batch in one script call; one answer per request, in order.
    pub async fn reserve(
        &self,
        reqs: &[ReserveRequest],
        p: ReserveParams,
    ) -> Result<Vec<Reservation>> {
        self.reserve_described(reqs, &[], p).await
    }

    /// [`Store::reserve`] that also writes each task's [`TaskDescription`] (`kind`,
    /// `submitted_at`) into its status record with its state, in the same script call.
    /// `descs` is empty (nothing written) or one per request, in order.
    pub async fn reserve_described(
        &self,
        reqs: &[ReserveRequest],
        descs: &[TaskDescription],
        p: ReserveParams,
    ) -> Result<Vec<Reservation>> {
        self.reserve_paused(reqs, descs, p, &[]).await
    }

    /// [`Store::reserve_keyed`] with no key limits and no fair queues (every key unlimited).
    pub async fn reserve_paused(
        &self,
        reqs: &[ReserveRequest],
        descs: &[TaskDescription],
        p: ReserveParams,
        paused: &[(String, Lane)],
    ) -> Result<Vec<Reservation>> {
        Ok(self
            .reserve_keyed(reqs, descs, p, paused, &|_| KeyArg::default(), 0)
            .await?
            .answers)
    }

    /// [`Store::reserve_described`] with the paused group lanes `paused` (operator pauses,
    /// [`crate::control::PauseSet::group_lanes`]): a paused lane is never chosen; a task only
    /// paused lanes could take is answered [`Reservation::Full`] naming one of them. Passed
    /// as arguments of the same call: no command more. Each fairness key of the batch is told
    /// its limits (`keys`, asked once per key) and counted (see `reserve.lua`); a keyed task
    /// that waits parks in one of `fair_queues` fair park queues of its group's normal lane
    /// (0: in the group's park queue).
    pub async fn reserve_keyed(
        &self,
        reqs: &[ReserveRequest],
        descs: &[TaskDescription],
        p: ReserveParams,
        paused: &[(String, Lane)],
        keys: &(dyn Fn(&str) -> KeyArg + Sync),
        fair_queues: u16,
    ) -> Result<Reserved> {
        if reqs.is_empty() {
            return Ok(Reserved::default());
        }
        // The batch's distinct keys, sent once each with their limits.
        let mut key_names: Vec<&str> = Vec::new();
        let mut key_index: std::collections::HashMap<&str, usize> =
            std::collections::HashMap::new();
        let key_of: Vec<usize> = reqs
            .iter()
            .map(|r| match r.key.as_deref() {
                None => 0,
                Some(k) => *key_index.entry(k).or_insert_with(|| {
                    key_names.push(k);
                    key_names.len()
                }),
            })
            .collect();
        // The batch's distinct selectors, sent once each; every task names its own by index.
        let mut selectors: Vec<Vec<String>> = Vec::new();
        let mut index: std::collections::HashMap<&Labels, usize> = std::collections::HashMap::new();
        let which: Vec<usize> = reqs
            .iter()
            .map(|r| {
                *index.entry(&r.selector).or_insert_with(|| {
                    selectors.push(r.selector.pairs());
                    selectors.len()
                })
            })
            .collect();
        let mut inv = self.scripts.reserve.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(p.token)
            .arg(p.lease_ms)
            .arg(p.backlog_factor)
            .arg(p.strategy.as_str())
            .arg(p.dedupe_window_ms)
            .arg(p.status_ttl_ms)
            .arg(u8::from(p.direct))
            .arg(p.park_flag_ttl_ms)
            .arg(rand::random::<u32>())
            .arg(paused.len());
        for (g, lane) in paused {
            inv.arg(format!("{g}|{}", lane.as_str()));
        }
        inv.arg(key_names.len()).arg(fair_queues);
        for k in &key_names {
            let a = keys(k);
            inv.arg(*k)
                .arg(a.max_running.map(|m| m.to_string()).unwrap_or_default())
                .arg(a.rate.map(|(r, _)| r.to_string()).unwrap_or_default())
                .arg(a.rate.map_or(1, |(_, b)| b))
                .arg(if a.paused { "1" } else { "0" });
        }
        inv.arg(selectors.len());
        for pairs in &selectors {
            inv.arg(pairs.len()).arg(pairs);
        }
        let descs = if descs.len() == reqs.len() {
            descs
        } else {
            &[]
        };
        inv.arg(descs.len());
        for d in descs {
            inv.arg(&d.kind).arg(
                d.submitted_at_ms
                    .map(|ms| ms.to_string())
                    .unwrap_or_default(),
            );
        }
        inv.arg(reqs.len());
        for ((r, k), key) in reqs.iter().zip(which).zip(key_of) {
            inv.arg(&r.id)
                .arg(r.lane.as_str())
                .arg(r.strategy.map(Strategy::as_str).unwrap_or(""))
                .arg(match r.dedupe {
                    Dedupe::Skip => 0,
                    Dedupe::Check => 1,
                    Dedupe::Mark => 2,
                })
                .arg(if r.dedupe_only {
                    2
                } else if r.from_park {
                    1
                } else {
                    0
                })
                .arg(k)
                .arg(&r.kind)
                .arg(key);
        }
        // Two entries per task, answer then group (see `reserve.lua`), then the key figures.
        let raw: Vec<String> = self.invoke(&inv).await?;
        let n = 2 * reqs.len();
        let (tasks, tail) = raw.split_at(n.min(raw.len()));
        let reclaimed = tail.first().and_then(|s| s.parse().ok()).unwrap_or(0);
        let used = tail
            .get(1..)
            .unwrap_or_default()
            .chunks(3)
            .filter_map(|kv| match kv {
                [k, u, b] => Some((k.clone(), u.parse::<u32>().ok(), b == "1")),
                _ => None,
            })
            .collect();
        let key_park = |place: &str, blocked: bool| match place.split_once('|') {
            Some((q, g)) => Reservation::KeyPark {
                group: g.to_string(),
                queue: q.parse().ok(),
                blocked,
            },
            None => Reservation::Failed(format!("reserve script answered a park at {place:?}")),
        };
        let answers = tasks
            .chunks(2)
            .map(|pair| match pair {
                [answer, group] => match answer.as_str() {
                    "reserved" => Reservation::Reserved(group.clone()),
                    "full" => Reservation::Full(group.clone()),
                    "kfull" => key_park(group, false),
                    "kwait" => key_park(group, true),
                    "dup" => Reservation::Duplicate,
                    "fresh" => Reservation::Fresh,
                    "cancelled" => Reservation::Cancelled,
                    "none" => Reservation::NoMatch,
                    other => Reservation::Failed(format!("reserve script answered {other:?}")),
                },
                _ => Reservation::Failed("reserve script answered an odd number of entries".into()),
            })
            .collect();
        Ok(Reserved {
            answers,
            reclaimed,
            used,
        })
    }

    /// The oldest reservation of a group's lane not started yet whose lease is still live: its
    /// task id and lease expiry (Redis-clock ms); `None` when there is none. A lapsed lease
    /// still in the set (`reserve.lua` drops them when a group runs out of room, or in one
    /// batch of 32) is not a task waiting.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn oldest_reservation(
        &self,
        group: &str,
        lane: Lane,
    ) -> Result<Option<(String, i64)>> {
        let first: Vec<(String, f64)> = self
            .query(
                redis::cmd("ZRANGE")
                    .arg(self.names.reserved(group, lane))
                    .arg(format!("({}", self.clock.now_ms()))
                    .arg("+inf")
                    .arg("BYSCORE")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(1)
                    .arg("WITHSCORES"),
            )
            .await?;
        Ok(first.into_iter().next().map(|(id, exp)| (id, exp as i64)))
    }

    /// Gives back reservations whose publish failed.
    pub async fn unreserve(&self, items: &[(String, Lane, String)]) -> Result<()> {
        let keyed: Vec<_> = items
            .iter()
            .map(|(g, l, id)| (g.clone(), *l, id.clone(), None))
            .collect();
        self.unreserve_keyed(&keyed).await
    }

    /// Gives back reservations whose publish failed: (group, lane, task id, fairness key).
    pub async fn unreserve_keyed(
        &self,
        items: &[(String, Lane, String, Option<String>)],
    ) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for (group, lane, id, key) in items {
            p.cmd("ZREM")
                .arg(self.names.reserved(group, *lane))
                .arg(id)
                .ignore();
            if let Some(k) = key {
                p.cmd("ZREM")
                    .arg(self.names.key_reserved(k))
                    .arg(id)
                    .ignore();
            }
        }
        self.pipe::<()>(&p).await
    }
}
