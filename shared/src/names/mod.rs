//! The one place that builds every namespaced AMQP name and Redis key.
//!
//! Redis keys are `{<ns>}:<kind>:<id>`: the braces make the namespace a Redis Cluster hash tag,
//! so every key of one fleet lives in one slot and the Lua scripts may touch keys they derive
//! from the prefix (the reservation script cannot know its candidate groups before it reads the
//! label index). The Lua side builds keys with the same layout in `names/keys.lua` (its `K_*`
//! functions); a test runs those in Redis and compares them with these, so the two cannot drift.

use crate::task::Lane;

/// AMQP names and Redis keys of one namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    ns: String,
    prefix: String,
}

impl Names {
    /// The names of `namespace` (AMQP names start `<namespace>.`, Redis keys `{<namespace>}:`).
    /// The namespace is used as given; settings validate it.
    pub fn new(namespace: &str) -> Self {
        Names {
            ns: namespace.to_string(),
            prefix: format!("{{{namespace}}}:"),
        }
    }

    /// The namespace these names belong to.
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    // ---- AMQP ----

    /// Producers publish here, routing key = lane.
    pub fn submit_exchange(&self) -> String {
        format!("{}.submit", self.ns)
    }
    /// Group lane queues, dead letters and the delayed queue are bound here.
    pub fn tasks_exchange(&self) -> String {
        format!("{}.tasks", self.ns)
    }
    /// Headers exchange in front of the delay tiers (header `fleet-tier`). Named `.hold` since
    /// the scheduler holds the tiers itself (issue 37, [`crate::broker::delay`]): the TTL tiers of
    /// before (`<ns>.wait`, `<ns>.wait.<ms>`, see [`Names::ttl_delay_exchange`]) and the
    /// classic ones before those (`<ns>.delay`, [`Names::legacy_delay_exchange`]) cannot be
    /// redeclared without their TTL and dead-letter arguments, so they are left behind, bound
    /// to nothing new, and drain into `<ns>.delayed` by their TTL.
    pub fn delay_exchange(&self) -> String {
        format!("{}.hold", self.ns)
    }
    /// The delay exchange of versions whose tiers expired messages into `<ns>.delayed` by TTL
    /// (clean-up only; its tiers, [`Names::ttl_delay_queue`], still drain on their own).
    pub fn ttl_delay_exchange(&self) -> String {
        format!("{}.wait", self.ns)
    }
    /// The delay exchange of versions whose tiers were classic queues (clean-up only).
    pub fn legacy_delay_exchange(&self) -> String {
        format!("{}.delay", self.ns)
    }
    /// A lane's ingress queue (`<ns>.ingress.<lane>`): what producers submitted, before the
    /// scheduler routes it.
    pub fn ingress_queue(&self, lane: Lane) -> String {
        format!("{}.ingress.{}", self.ns, lane)
    }
    /// A group's lane queue (`<ns>.group.<group>.<lane>`), which its workers consume.
    pub fn group_queue(&self, group: &str, lane: Lane) -> String {
        format!("{}.group.{}.{}", self.ns, group, lane)
    }
    /// Routing key of a group lane queue on the tasks exchange.
    pub fn group_key(&self, group: &str, lane: Lane) -> String {
        format!("group.{group}.{lane}")
    }
    /// Shard `shard` of `shards` of a group's lane queue: `<ns>.group.<group>.<lane>.<shard>`,
    /// or the unsharded [`group_queue`](Self::group_queue) name when `shards` is 1.
    pub fn group_shard_queue(&self, group: &str, lane: Lane, shard: u32, shards: u32) -> String {
        if shards <= 1 {
            self.group_queue(group, lane)
        } else {
            format!("{}.group.{}.{}.{}", self.ns, group, lane, shard)
        }
    }
    /// Routing key of [`group_shard_queue`](Self::group_shard_queue) on the tasks exchange.
    pub fn group_shard_key(&self, group: &str, lane: Lane, shard: u32, shards: u32) -> String {
        if shards <= 1 {
            self.group_key(group, lane)
        } else {
            format!("group.{group}.{lane}.{shard}")
        }
    }
    /// Every shard queue of a group's lane (one name when unsharded).
    pub fn group_shard_queues(&self, group: &str, lane: Lane, shards: u32) -> Vec<String> {
        (0..shards.max(1))
            .map(|s| self.group_shard_queue(group, lane, s, shards))
            .collect()
    }
    /// Bounded durable queue holding a group's tasks while it has no room.
    pub fn park_queue(&self, group: &str, lane: Lane) -> String {
        format!("{}.park.{}.{}", self.ns, group, lane)
    }
    /// The pseudo-group whose park queue is fair park queue `queue` of `group`:
    /// `<group>~k<queue>` (its queue `<ns>.park.<group>~k<queue>.<lane>`). Keyed tasks that wait
    /// for a group park in one of its fair queues (`FLEET_FAIR_QUEUES`), one per waiting key
    /// while there are no more keys than queues, so the group's release loop sees every
    /// key's head at once (see `scheduler::park::fair`). `~` is in no label.
    pub fn fair_group(group: &str, queue: u16) -> String {
        format!("{group}{}{queue}", Self::FAIR_SEP)
    }
    /// What separates a group from its fair queue's index in [`Names::fair_group`].
    pub const FAIR_SEP: &'static str = "~k";
    /// The group and queue index of a [`Names::fair_group`] pseudo-group name.
    pub fn fair_of(pseudo: &str) -> Option<(&str, u16)> {
        let (g, q) = pseudo.rsplit_once(Self::FAIR_SEP)?;
        Some((g, q.parse().ok()?))
    }
    /// The pseudo-group whose park queues (`<ns>.park._unmatched.<lane>`) hold the tasks no
    /// live group matches yet (the scheduler's waiting-for-worker tasks).
    pub const UNMATCHED_GROUP: &'static str = "_unmatched";
    /// Routing key of [`park_queue`](Self::park_queue) on the tasks exchange.
    pub fn park_key(&self, group: &str, lane: Lane) -> String {
        format!("park.{group}.{lane}")
    }
    /// The dead-letter queue (`<ns>.dead`): tasks that will not run, each with its reason
    /// headers.
    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.ns)
    }
    /// Routing key of [`dead_queue`](Self::dead_queue) on the tasks exchange.
    pub const DEAD_KEY: &'static str = "dead";
    /// Internal queue of the dead letters the broker makes itself (a quorum group queue's
    /// delivery limit): the group queues' dead-letter routing key leads here, and the scheduler
    /// gives each letter a reason and a status before moving it to [`Names::dead_queue`].
    pub fn broker_dead_queue(&self) -> String {
        format!("{}.dead.broker", self.ns)
    }
    /// Routing key of [`broker_dead_queue`](Self::broker_dead_queue) on the tasks exchange.
    pub const BROKER_DEAD_KEY: &'static str = "dead.broker";
    /// The cancelled-task queue (`<ns>.cancelled`): the message of each task an operator
    /// cancelled, kept where its copy was dropped so that `POST /v1/tasks/bulk` can retry it
    /// as a new run (never in [`dead_queue`](Self::dead_queue)). Bounded and aged: see
    /// `broker::topology::declare_core`.
    pub fn cancelled_queue(&self) -> String {
        format!("{}.cancelled", self.ns)
    }
    /// Routing key of [`cancelled_queue`](Self::cancelled_queue) on the tasks exchange.
    pub const CANCELLED_KEY: &'static str = "cancelled";
    /// Tasks coming back from a delay tier (delayed start, retry backoff) to the scheduler.
    pub fn delayed_queue(&self) -> String {
        format!("{}.delayed", self.ns)
    }
    /// Routing key of [`delayed_queue`](Self::delayed_queue) on the tasks exchange.
    pub const DELAYED_KEY: &'static str = "delayed";
    /// Stream (durable, replayed from its start) holding the periodic schedules' definitions.
    pub fn schedules_stream(&self) -> String {
        format!("{}.schedules", self.ns)
    }
    /// Stream (durable, read from its start by every scheduler and worker) of operator
    /// actions that must outlive Redis: cancels ([`crate::control`]).
    pub fn control_stream(&self) -> String {
        format!("{}.control", self.ns)
    }
    /// The namespace's queue catalog: a durable queue holding one record per declaration of a
    /// group's queues (its name and the exact queue names), written before the queues are
    /// declared and read by `fleetctl delete-namespace`, so the clean-up finds every group
    /// queue whatever Redis holds (AMQP has no queue listing). See
    /// [`crate::broker::topology::record_group`].
    pub fn catalog_queue(&self) -> String {
        format!("{}.catalog", self.ns)
    }
    /// One delay tier: every message waits `tier_ms` milliseconds, held by the scheduler's
    /// tier loop, then goes on to [`Names::delayed_queue`] (see [`crate::broker::delay`]).
    pub fn delay_queue(&self, tier_ms: u64) -> String {
        format!("{}.hold.{}", self.ns, tier_ms)
    }
    /// A delay tier of versions whose tiers expired messages by TTL into
    /// [`Names::delayed_queue`] (clean-up only).
    pub fn ttl_delay_queue(&self, tier_ms: u64) -> String {
        format!("{}.wait.{}", self.ns, tier_ms)
    }
    /// A delay tier of versions whose tiers were classic queues (clean-up only).
    pub fn legacy_delay_queue(&self, tier_ms: u64) -> String {
        format!("{}.delay.{}", self.ns, tier_ms)
    }

    /// Exclusive, auto-delete queue a worker process declares to hold its id: the broker
    /// deletes it the moment that process's connection closes (crash, kill -9), so a worker
    /// restarted with the same id that can declare it knows its predecessor is gone.
    pub fn worker_lock_queue(&self, worker_id: &str) -> String {
        format!("{}.lock.worker.{}", self.ns, worker_id)
    }

    // ---- Redis ----

    /// The key prefix every script receives as `KEYS[1]`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
    /// Key saying this Redis holds the control stream's cancel marks: a Redis loss takes it,
    /// and the schedulers then write the marks again ([`crate::control`]).
    pub fn control_applied(&self) -> String {
        format!("{}ctl", self.prefix)
    }
    /// Key written by readiness probes: `/readyz` means "Redis takes writes", not only "it
    /// answers PING" (a read-only replica answers PING).
    pub fn ready_probe_key(&self) -> String {
        format!("{}readyz", self.prefix)
    }

    /// Sorted set of every registered worker id, scored by its last heartbeat (Redis time, ms).
    pub fn workers(&self) -> String {
        format!("{}workers", self.prefix)
    }
    /// Hash of one worker's registration and last heartbeat: id, instance, group, labels,
    /// capacities, executor, state, `hb` / `started` (ms), outcome counts, load, cpu, kinds.
    pub fn worker(&self, id: &str) -> String {
        format!("{}w:{}", self.prefix, id)
    }
    /// A worker's wait-time histogram (see `waits`), written at each heartbeat.
    pub fn waits(&self, id: &str) -> String {
        format!("{}wait:{}", self.prefix, id)
    }
    /// Set of the runs a worker holds, as `<lane>|<task id>` (their leases are in
    /// [`running`](Self::running)); released when it deregisters or is evicted.
    pub fn worker_running(&self, id: &str) -> String {
        format!("{}wrun:{}", self.prefix, id)
    }
    /// Set of every known group name (label set): added when a worker of it registers, removed
    /// when the group is reclaimed.
    pub fn groups(&self) -> String {
        format!("{}groups", self.prefix)
    }
    /// Hash of one group: its `labels` (JSON), each worker's health (`h:<id>`) and, once its
    /// last worker left, `idle` (Redis time, ms: the start of its reclaim grace).
    pub fn group(&self, group: &str) -> String {
        format!("{}g:{}", self.prefix, group)
    }
    /// Set of the worker ids registered in a group.
    pub fn group_workers(&self, group: &str) -> String {
        format!("{}gw:{}", self.prefix, group)
    }
    /// Hash of a group's worker ordinals (ordinal → worker id), for subsetting.
    pub fn group_ordinals(&self, group: &str) -> String {
        format!("{}gord:{}", self.prefix, group)
    }
    /// Sorted set of the task ids dispatched to a group's lane and not started yet, scored by
    /// when the reservation lapses (Redis time, ms).
    pub fn reserved(&self, group: &str, lane: Lane) -> String {
        format!("{}resv:{}:{}", self.prefix, group, lane)
    }
    /// Sorted set of the task ids running in a group's lane, scored by when their run lease
    /// lapses (Redis time, ms; heartbeats renew it).
    pub fn running(&self, group: &str, lane: Lane) -> String {
        format!("{}run:{}:{}", self.prefix, group, lane)
    }
    /// Sorted set of the task ids of fairness key `key` reserved (dispatched, not started),
    /// scored by when the reservation lapses (Redis ms). See `names/keys.lua` (`K_kq`).
    pub fn key_reserved(&self, key: &str) -> String {
        format!("{}kq:{}", self.prefix, key)
    }
    /// Sorted set of the task ids of fairness key `key` running, scored by when their run
    /// lease lapses (Redis ms; heartbeats renew it).
    pub fn key_running(&self, key: &str) -> String {
        format!("{}kr:{}", self.prefix, key)
    }
    /// Token bucket of fairness key `key`'s rate limit (hash {tokens, ts}).
    pub fn key_bucket(&self, key: &str) -> String {
        format!("{}kb:{}", self.prefix, key)
    }
    /// Hash of a group lane's fair park queue assignments (key → queue index, `#` → keys
    /// assigned so far), written by `reserve.lua`.
    pub fn fair_assignments(&self, group: &str, lane: Lane) -> String {
        format!("{}fsh:{}:{}", self.prefix, group, lane)
    }
    /// Hash of every fairness key's figures: `d:<key>` tasks dispatched (total), `w:<key>`
    /// tasks parked waiting now, `t:<key>` its last activity (Redis ms).
    pub fn key_figures(&self) -> String {
        format!("{}kf", self.prefix)
    }
    /// The keys that may hold a live lease: a sorted set, member = fairness key, score = the
    /// latest lease expiry (Redis ms) written to its reserved or running set (`ZADD GT`, by
    /// the reservation, the claim and the heartbeat). A key scored below now holds none.
    pub fn key_active(&self) -> String {
        format!("{}ka", self.prefix)
    }
    /// The label index: the set of groups whose labels hold the pair `k=v`.
    pub fn label_index(&self, pair: &str) -> String {
        format!("{}idx:{}", self.prefix, pair)
    }
    /// The round-robin counter of a lane and a selector (its pairs joined by `,`).
    pub fn round_robin(&self, lane: Lane, selector: &str) -> String {
        format!("{}rr:{}:{}", self.prefix, lane, selector)
    }
    /// Flag (a string with a TTL) that a group's lane has tasks in its park queue, so the
    /// reservation script sends new work there behind them.
    pub fn parked(&self, group: &str, lane: Lane) -> String {
        format!("{}pk:{}:{}", self.prefix, group, lane)
    }
    /// Tombstone of a group being reclaimed (`pending`) or reclaimed (the time its queues were
    /// deleted, ms); it expires by itself. See `registry/reclaim.lua`.
    pub fn reclaimed(&self, group: &str) -> String {
        format!("{}rc:{}", self.prefix, group)
    }
    /// Token bucket of a lane's dispatch rate limit (see `fleet::ratelimit`).
    pub fn rate_limit(&self, lane: Lane) -> String {
        format!("{}rl:{}", self.prefix, lane)
    }
    /// Bucket of the optional HTTP submission limit.
    pub fn submit_rate_limit(&self) -> String {
        format!("{}rl:submit", self.prefix)
    }
    /// Hash of a task's status (state, attempt, times, result or error; see `fleet::status`),
    /// kept for the status TTL.
    pub fn task(&self, id: &str) -> String {
        format!("{}t:{}", self.prefix, id)
    }
    /// The task index (a sorted set: member = task id, score = the run's submitted_at, Unix
    /// ms), written by the status writer that creates a run's record; see
    /// [`crate::status::index`].
    pub fn task_index(&self) -> String {
        format!("{}tix", self.prefix)
    }
    /// A task's attempt log: a capped list of JSON entries (see `status::ATTEMPT_LOG_MAX`).
    pub fn attempts(&self, id: &str) -> String {
        format!("{}ta:{}", self.prefix, id)
    }
    /// A dispatch batch's "handed on" flag (a string `1` with the dedupe window as TTL): every
    /// submission whose dedupe mark is `p:<token>` was handed on — its publishes confirmed and
    /// its ingress message about to be acked — so a redelivery of it is a duplicate. One write
    /// per batch instead of one mark per task (`fleet::route::dedupe`).
    pub fn handed_on(&self, token: &str) -> String {
        format!("{}ho:{}", self.prefix, token)
    }
    /// The dead-queue reader lease (a string: the holder's token, with a TTL): one reader of
    /// `<ns>.dead` at a time across every process (see `fleet::broker::dead`).
    pub fn dead_lock(&self) -> String {
        format!("{}deadrd", self.prefix)
    }
    /// Claim / outcome of one tick of a schedule (`tick_ms`: the tick, ms since the epoch).
    pub fn schedule_tick(&self, schedule: &str, tick_ms: i64) -> String {
        format!("{}sk:{}:{}", self.prefix, schedule, tick_ms)
    }
    /// Latest tick of a schedule that was fired or counted missed (ms since the epoch).
    pub fn schedule_last(&self, schedule: &str) -> String {
        format!("{}sl:{}", self.prefix, schedule)
    }
    /// Pattern matching every key of the namespace (for tests' clean-up).
    pub fn all_keys_pattern(&self) -> String {
        format!("{}*", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_namespace() {
        let n = Names::new("t1");
        assert_eq!(n.ingress_queue(Lane::Critical), "t1.ingress.critical");
        assert_eq!(
            n.group_queue("gpu=true", Lane::Normal),
            "t1.group.gpu=true.normal"
        );
        assert_eq!(
            n.group_shard_queue("g", Lane::Normal, 0, 1),
            "t1.group.g.normal"
        );
        assert_eq!(
            n.group_shard_queue("g", Lane::Normal, 7, 12),
            "t1.group.g.normal.7"
        );
        assert_eq!(
            n.group_shard_key("g", Lane::Normal, 7, 12),
            "group.g.normal.7"
        );
        assert_eq!(n.group_shard_queues("g", Lane::Normal, 3).len(), 3);
        assert_eq!(n.group_ordinals("g"), "{t1}:gord:g");
        assert_eq!(n.worker("w1"), "{t1}:w:w1");
        assert_eq!(n.reserved("g", Lane::Normal), "{t1}:resv:g:normal");
    }

    /// Every key builder of `names/keys.lua`, run in Redis (EVAL of the prelude), renders the
    /// same key as its counterpart here.
    #[tokio::test]
    async fn the_scripts_key_layout_is_names() -> crate::Result<()> {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let n = Names::new(&format!("keys-{}", uuid::Uuid::new_v4().simple()));
        let store = crate::Store::new(&url, n.clone())?;
        let (l, c) = (Lane::Normal, Lane::Critical);
        let pairs: Vec<(&str, String)> = vec![
            ("K_workers()", n.workers()),
            ("K_worker('w1')", n.worker("w1")),
            ("K_wrun('w1')", n.worker_running("w1")),
            ("K_groups()", n.groups()),
            ("K_group('g=1')", n.group("g=1")),
            ("K_gw('g=1')", n.group_workers("g=1")),
            ("K_gord('g=1')", n.group_ordinals("g=1")),
            ("K_idx('a=b')", n.label_index("a=b")),
            ("K_resv('g=1', 'normal')", n.reserved("g=1", l)),
            ("K_run('g=1', 'critical')", n.running("g=1", c)),
            ("K_task('t-1')", n.task("t-1")),
            ("K_attempts('t-1')", n.attempts("t-1")),
            ("K_handed('17')", n.handed_on("17")),
            ("K_parked('g=1', 'normal')", n.parked("g=1", l)),
            ("K_rr('normal', 'a=b,c=d')", n.round_robin(l, "a=b,c=d")),
            ("K_reclaim('g=1')", n.reclaimed("g=1")),
            ("K_dead_lock()", n.dead_lock()),
            ("K_tix()", n.task_index()),
            ("K_kq('acme')", n.key_reserved("acme")),
            ("K_kr('acme')", n.key_running("acme")),
            ("K_kb('acme')", n.key_bucket("acme")),
            ("K_kf()", n.key_figures()),
            ("K_ka()", n.key_active()),
            ("K_fsh('g=1', 'normal')", n.fair_assignments("g=1", l)),
        ];
        let calls: Vec<&str> = pairs.iter().map(|(call, _)| *call).collect();
        let script = format!(
            "{}\nreturn {{ {} }}",
            crate::redis::PRELUDE,
            calls.join(", ")
        );
        let lua: Vec<String> = store
            .query(
                deadpool_redis::redis::cmd("EVAL")
                    .arg(script)
                    .arg(1)
                    .arg(n.prefix()),
            )
            .await?;
        let rust: Vec<String> = pairs.iter().map(|(_, k)| k.clone()).collect();
        assert_eq!(lua, rust, "keys.lua and Names disagree on the key layout");
        // Every builder of keys.lua is compared above.
        let builders = crate::redis::PRELUDE
            .lines()
            .filter(|l| l.starts_with("local function K_"))
            .count();
        assert_eq!(
            builders,
            pairs.len(),
            "a key builder of keys.lua is missing from this test"
        );
        Ok(())
    }
}
