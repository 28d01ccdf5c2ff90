-- Prelude of every fleet script: key layout under the namespace prefix KEYS[1]
-- (`{ns}:`, a Redis Cluster hash tag, so all keys of a fleet share one slot).
-- Mirrors `Names` in shared/src/names/mod.rs; keep both in step.
-- The globals the scripts use per task, as locals: in Lua 5.1 every use of a global is a
-- lookup in the globals table, a local is a register (callgrind: BENCHMARKS.md round 20).
local ARGV, KEYS, tonumber, tostring, type, unpack, ipairs, pairs = ARGV, KEYS, tonumber, tostring, type, unpack, ipairs, pairs
local P = KEYS[1]
-- One clock for the whole fleet: the Redis server's (leases, heartbeats, eviction, status
-- times), so a process with a skewed clock neither evicts its peers nor expires their work.
local T0 = redis.call('TIME')
local NOW_MS = tonumber(T0[1]) * 1000 + math.floor(tonumber(T0[2]) / 1000)
-- The same instant as a string, built from TIME's strings: what the scripts store and send.
-- A Lua number passed to redis.call becomes a string through "%.17g" (and `tostring` through
-- "%.14g"), which glibc formats with multi-precision arithmetic — 0.3-1.3 µs a time on this
-- machine, against 1-1.5 µs for a whole HSET (BENCHMARKS.md round 20) — and the command then
-- parses it back. The hot paths send strings: NOW_STR, and `numstr()` once per script for a
-- batch's shared figures (lease scores, the dedupe mark's lapse).
local NOW_STR = T0[1] .. string.format('%03d', math.floor(tonumber(T0[2]) / 1000))
-- An integral number as a string without "%.14g" (see NOW_STR): the scripts' figures (times,
-- leases, scores) are whole numbers well inside 2^53.
local function numstr(x) return string.format('%d', x) end
-- numstr of a TTL, made once per value per script (a batch's TTLs are one or two values).
local TTL_STR = {}
local function ttlstr(v)
  local s = TTL_STR[v]
  if not s then s = numstr(v); TTL_STR[v] = s end
  return s
end
local function K_workers() return P .. 'workers' end
local function K_worker(id) return P .. 'w:' .. id end
local function K_wrun(id) return P .. 'wrun:' .. id end
local function K_groups() return P .. 'groups' end
local function K_group(g) return P .. 'g:' .. g end
local function K_gw(g) return P .. 'gw:' .. g end
local function K_gord(g) return P .. 'gord:' .. g end
local function K_idx(pair) return P .. 'idx:' .. pair end
local function K_resv(g, lane) return P .. 'resv:' .. g .. ':' .. lane end
local function K_run(g, lane) return P .. 'run:' .. g .. ':' .. lane end
local function K_task(id) return P .. 't:' .. id end
local function K_attempts(id) return P .. 'ta:' .. id end
-- A dispatch batch's handed-on flag (`fleet::route::dedupe`): marks `p:<token>` are handed on.
local function K_handed(token) return P .. 'ho:' .. token end
local function K_parked(g, lane) return P .. 'pk:' .. g .. ':' .. lane end
local function K_rr(lane, sel) return P .. 'rr:' .. lane .. ':' .. sel end
-- Fairness keys (tenants, `fleet::control::KeyLimits`): per key the task ids reserved for it
-- (`kq:`) and running (`kr:`), each a sorted set scored by when its lease lapses (Redis ms),
-- exactly like a group's resv/run sets — running + reserved is what `max_running` bounds;
-- its token bucket (`kb:`, a hash {tokens, ts}); and one hash of every key's figures (`kf`:
-- `d:<key>` tasks dispatched, `w:<key>` tasks parked waiting, `t:<key>` last activity ms).
local function K_kq(key) return P .. 'kq:' .. key end
local function K_kr(key) return P .. 'kr:' .. key end
local function K_kb(key) return P .. 'kb:' .. key end
local function K_kf() return P .. 'kf' end
-- The keys that may hold a live lease (a sorted set: member = key, score = the latest lease
-- expiry written to its kq:/kr: sets, Redis ms, kept by `ZADD GT` beside every such write):
-- a key scored below now holds no live lease, so the figures count only the keys at or above
-- it (`fleet::Store::key_figures`) however many keys were ever seen.
local function K_ka() return P .. 'ka' end
-- Scores each of `names` (fairness keys, each once) in K_ka at `until_` unless it is scored
-- higher already: one variadic `ZADD GT` (Redis ≥ 6.2) per call, whatever the number of keys.
local function keys_leased(names, until_)
  local a = {}
  for i, k in ipairs(names) do a[2 * i - 1] = until_; a[2 * i] = k end
  for c = 1, #a, 4000 do
    redis.call('ZADD', K_ka(), 'GT', unpack(a, c, math.min(c + 3999, #a)))
  end
end
-- A group lane's fair park queues: which queue each fairness key parks in (reserve.lua).
local function K_fsh(g, lane) return P .. 'fsh:' .. g .. ':' .. lane end
-- Tombstone of a group being (or just) reclaimed; see reclaim.lua.
local function K_reclaim(g) return P .. 'rc:' .. g end
-- The namespace's dead-queue reader lease (see dead_lock.lua, `fleet::broker::dead`).
local function K_dead_lock() return P .. 'deadrd' end
-- The task index (`fleet::status::index`): a sorted set, member = task id, score = the run's
-- submitted_at (Unix ms; the Redis clock when unknown). Written once per run, by the status
-- writer that creates the run's record (index_run below): no command on any later transition.
local TIX = P .. 'tix'
local function K_tix() return TIX end

-- Deferred set writes: a script that touches many tasks collects the members of each sorted
-- set or set (`defer('ZADD', key, score, member)`, `defer('ZREM', key, member)`, SADD, SREM)
-- and sends every key's once, variadic (`flush_deferred()`, before it returns): Redis's cost
-- is per command far more than per member (`INFO commandstats`, BENCHMARKS.md round 17), so a
-- batch of 100 claims costs one ZADD, not 100. Only for writes that nothing later in the same
-- script reads back. Members of one key go in the order deferred (a ZADD after a ZREM of the
-- same member in one script would be reordered: callers never do both).
-- (DEFERRED is by op, then by key: no string is built per call.)
local DEFERRED, DEFERRED_KEYS = {}, {}
local function defer(op, key, a, b)
  local byop = DEFERRED[op]
  if not byop then byop = {}; DEFERRED[op] = byop end
  local d = byop[key]
  if not d then
    d = { op = op, key = key, n = 0 }
    byop[key] = d
    DEFERRED_KEYS[#DEFERRED_KEYS + 1] = d
  end
  d.n = d.n + 1; d[d.n] = a
  if b ~= nil then d.n = d.n + 1; d[d.n] = b end
end
local function flush_deferred()
  for _, d in ipairs(DEFERRED_KEYS) do
    -- At most 4,000 arguments per call (an even number: ZADD's pairs stay whole), well under
    -- Lua's unpack limit.
    for s = 1, d.n, 4000 do
      redis.call(d.op, d.key, unpack(d, s, math.min(s + 3999, d.n)))
    end
  end
  DEFERRED, DEFERRED_KEYS = {}, {}
end
-- Whether index_run defers its ZADD (a script that sets it calls flush_deferred).
local DEFER_INDEX = false

-- The attempt log of a task (`ta:<id>`, a list of JSON objects, oldest first): one entry per
-- attempt that ended — {attempt, worker, started_at, finished_at (Redis ms), outcome
-- (succeeded | failed | dead | expired | lost), error, reason} — written by the script that
-- records the outcome (finish.lua; a lost attempt by remove_worker or start.lua, whichever
-- notices first), except a success the status record keeps (finish.lua says which). Capped at
-- ATTEMPT_LOG_MAX entries (the oldest dropped); it lives as long as the status record
-- (`ttl_ms`: the status TTL). Mirrors `fleet::status::ATTEMPT_LOG_MAX`.
local ATTEMPT_LOG_MAX = 20
local function log_attempt(id, entry, ttl_ms)
  local k = K_attempts(id)
  if redis.call('RPUSH', k, cjson.encode(entry)) > ATTEMPT_LOG_MAX then
    redis.call('LTRIM', k, -ATTEMPT_LOG_MAX, -1)
  end
  redis.call('PEXPIRE', k, ttl_ms)
end

-- Task states, dead-letter reasons and attempt outcomes, as stored: the words of
-- `fleet::status::{TaskState, DeadReason, AttemptOutcome}` (a unit test checks these tables
-- and every such word in the scripts against the enums, so scripts spell them S.x, R.x, O.x).
local S = { queued = 'queued', parked = 'parked', running = 'running', retrying = 'retrying', succeeded = 'succeeded', dead = 'dead', expired = 'expired', cancelled = 'cancelled', waiting = 'waiting' }
local R = { worker_lost = 'worker_lost', max_attempts = 'max_attempts' }
local O = { succeeded = 'succeeded', failed = 'failed', dead = 'dead', expired = 'expired', lost = 'lost', cancelled = 'cancelled' }

-- A state that ends the task (`TaskState::is_terminal`).
local function is_final(state)
  return state == S.succeeded or state == S.dead or state == S.expired or state == S.cancelled
end

-- Indexes a run in K_tix: called by the writer that creates a run's record (no record before),
-- so a task costs one ZADD for its whole life. `score`: submitted_at (Unix ms) or '' / nil
-- for the Redis clock.
local function index_run(id, score)
  local s = tonumber(score)
  if not s or s <= 0 then
    s = NOW_STR
  elseif type(score) == 'string' and string.find(score, '^%d+$') then
    s = score
  else
    s = numstr(s)
  end
  if DEFER_INDEX then defer('ZADD', K_tix(), s, id) else redis.call('ZADD', K_tix(), s, id) end
end

-- ---- Status writers: the only code that sets a task's `state` (one function per transition;
-- the Rust side's are in `fleet::status`). `ttl_ms`: the status TTL. ----

-- Dispatched (S.queued, reserved in group g) or waiting for room (S.parked): never over a
-- claimed attempt — a copy made by a scheduler that took over a crashed one's batch finds the
-- task running or finished, and the worker acks that copy as a duplicate.
-- `kind` and `sub` (submitted_at, Unix ms): what the task is, written in the same HSET when
-- the caller knows them (nil or '' otherwise).
-- `fresh`: this call set the id's dedupe mark (a new submission, its window passed): a final
-- record is then an ended run's, and this is a new run (status_resubmitted, below).
local status_resubmitted
-- The dedupe mark of the task reserve.lua is handling, to be written into its status record
-- (`dd` = the mark, `ddx` = when it lapses, Redis ms) by the status write of the same call —
-- no command of its own — or by write_mark when no status is written. nil: none to write.
-- { value = 'p:<token>', until_ms = <Redis ms>, window = <ms> }
local MARK = nil
-- Appends the pending mark's fields to an HSET's `set` and clears it; returns the window (ms)
-- the record must live at least (0: no mark).
local function take_mark(set)
  local m = MARK
  if not m then return 0 end
  MARK = nil
  set[#set + 1] = 'dd'; set[#set + 1] = m.value
  set[#set + 1] = 'ddx'; set[#set + 1] = m.until_ms
  return m.window
end
-- Writes the pending mark, if any, into task id's record on its own: the record then lives at
-- least the window (the TTL is only ever raised here: PEXPIRE GT, or set on a new record).
local function write_mark(id, ttl_ms)
  if not MARK then return end
  local set = {}
  local win = take_mark(set)
  local t = K_task(id)
  redis.call('HSET', t, unpack(set))
  local keep = math.max(tonumber(ttl_ms) or 0, win)
  if redis.call('PEXPIRE', t, keep, 'GT') == 0 then redis.call('PEXPIRE', t, keep, 'NX') end
end
-- `cur`: the record's state as the caller read it (false: none), or nil to read it here.
-- `sel`: the task's selector (`k=v,k2=v2`, '' for none), written with `kind` (the task
-- list's label filter reads it). A record created here (none before) indexes the run.
-- `key`: the task's fairness key (nil or '' for none), written with `kind`: a cancel and an
-- eviction read it to give back the key's slot.
local function status_waiting(id, state, g, lane, ttl_ms, kind, sub, fresh, cur, sel, key)
  local t = K_task(id)
  if cur == nil then cur = redis.call('HGET', t, 'state') end
  if fresh and is_final(cur) then
    status_resubmitted(id, ttl_ms)
    cur = false
  end
  if cur == S.running or is_final(cur) then return end
  local set = { 'state', state, 'group', g, 'lane', lane, 'queued_at', NOW_STR }
  if kind and kind ~= '' then
    set[#set + 1] = 'kind'; set[#set + 1] = kind
    if sel then set[#set + 1] = 'selector'; set[#set + 1] = sel end
    if key and key ~= '' then set[#set + 1] = 'key'; set[#set + 1] = key end
  end
  if sub and sub ~= '' then set[#set + 1] = 'submitted_at'; set[#set + 1] = sub end
  -- The dedupe mark of a fresh submission rides in the same HSET (reserve.lua).
  local win = take_mark(set)
  redis.call('HSET', t, unpack(set))
  redis.call('PEXPIRE', t, ttlstr(math.max(tonumber(ttl_ms) or 0, win)))
  if not cur then index_run(id, sub) end
end
local function status_queued(id, g, lane, ttl_ms, kind, sub, fresh, cur, sel, key) status_waiting(id, S.queued, g, lane, ttl_ms, kind, sub, fresh, cur, sel, key) end
local function status_parked(id, g, lane, ttl_ms, kind, sub, fresh, cur, sel, key) status_waiting(id, S.parked, g, lane, ttl_ms, kind, sub, fresh, cur, sel, key) end

-- A state the scheduler decided (`fleet::status::Writes`, through status/decided.lua): dead or
-- expired before dispatch, waiting_for_worker, delayed. `set`: the fields to write, `state`
-- first. Never over a final state (succeeded, dead, expired, cancelled) of the same run: a
-- cancelled task whose deadline passes while it waits stays cancelled, and a delayed
-- submission a crashed scheduler handles again does not revive a cancel. (A new run of an id
-- whose last run ended has no record by now: reserve.lua's dedupe cleared it.) `waiting` is
-- written only over no record or `waiting`. Returns the state it left (final, or the one a
-- `waiting` met), or false when it wrote. `score`: the run's submitted_at (the index).
local function status_decided(id, set, ttl_ms, score)
  local t = K_task(id)
  local cur = redis.call('HGET', t, 'state')
  if is_final(cur) then return cur end
  -- `waiting` (a DAG member held by its batch) only before its release: a batch's close read
  -- again (redelivered, or by a replica that has not folded it yet) must not put a member
  -- that was released since (queued, running, ...) back to `waiting`.
  if set[2] == S.waiting and cur and cur ~= S.waiting then return cur end
  redis.call('HSET', t, unpack(set))
  redis.call('PEXPIRE', t, ttl_ms)
  if not cur then index_run(id, score) end
  return false
end

-- Claimed: attempt `att` runs on worker w (process inst) in group g; the run record (`run_*`,
-- see start.lua) says which copy of which attempt runs and whether alone (`iso`).
-- `prior`: what the caller read of the record — `exists` (a `state` field: the record and
-- its TTL, set at dispatch, are there) and `finished` (a `finished_at` of an earlier attempt)
-- — so a fresh claim costs one HSET: no HDEL of a field that is not there, and the TTL set
-- at dispatch stands (a record that expired while its task waited gets a new one).
local function status_running(id, g, lane, w, att, base, inst, iso, ttl_ms, prior)
  local t = K_task(id)
  redis.call('HSET', t, 'state', S.running, 'group', g, 'lane', lane, 'worker', w, 'attempt', numstr(att),
    'started_at', NOW_STR, 'run_base', numstr(base), 'run_owner', inst, 'run_st', 'run', 'run_iso', iso)
  if prior.finished then redis.call('HDEL', t, 'finished_at') end
  if not prior.exists then redis.call('PEXPIRE', t, ttl_ms) end
end

-- A crash suspect claimed by process inst of worker w, to run once that process runs nothing
-- else (start.lua): still S.queued, its run record held.
local function status_suspect(id, w, inst, att, ttl_ms)
  local t = K_task(id)
  redis.call('HSET', t, 'run_owner', inst, 'worker', w, 'run_st', 'run', 'run_iso', 's',
    'attempt', att, 'state', S.queued)
  redis.call('PEXPIRE', t, ttl_ms)
end

-- Back in the broker after an attempt that ended without an outcome: its worker died or left
-- (remove_worker; `run_st` nil: the record stays the lost owner's, so the next claim counts
-- the crash) or it was released (finish.lua; `run_st` 'rel': the next copy runs the attempt again).
local function status_requeued(id, run_st)
  local t = K_task(id)
  if run_st then
    redis.call('HSET', t, 'run_st', run_st, 'state', S.queued)
  else
    redis.call('HSET', t, 'state', S.queued)
  end
  redis.call('HDEL', t, 'worker', 'started_at')
end

-- Running again as far as anyone can tell: the run of process `inst` (still its owner) of
-- worker w went on while an eviction wrote it back to S.queued (heartbeat.lua, after the
-- worker registered again). Its start time went with the eviction.
local function status_resumed(id, w)
  -- A run an operator cancelled meanwhile stays cancelled (its worker is stopping it).
  if redis.call('HGET', K_task(id), 'state') == S.cancelled then return end
  redis.call('HSET', K_task(id), 'state', S.running, 'worker', w)
end

-- An attempt's outcome (finish.lua): `state` is S.succeeded, S.retrying, S.dead or S.expired,
-- written by worker w for attempt `att`; `field` ('result' | 'error') holds `text`; `reason`
-- ('' for none) why dead or expired; `done`: this process owns the run record (or none exists),
-- which then says the attempt is over. `prior`: which of `error` and `reason` the record holds
-- now (read by the caller), so only fields that are there are deleted, and `ttl_fresh`: the
-- record's TTL was set less than a tenth of the TTL ago (`queued_at`: every writer of that
-- field sets the TTL in the same script). One HSET and, rarely, one HDEL; the PEXPIRE only when
-- the TTL is not fresh — so a record lives at least 0.9 × the status TTL after its task ended
-- (exactly the TTL from the end for a task that waited or ran longer than a tenth of it).
local function status_finished(id, state, w, att, field, text, success, reason, done, ttl_ms, prior)
  local t = K_task(id)
  local set = { 'state', state, 'worker', w, 'finished_at', NOW_STR, 'attempt', numstr(att), field, text }
  if done then set[#set + 1] = 'run_st'; set[#set + 1] = 'done' end
  local del = {}
  -- A success after failed attempts: the earlier attempt's error no longer describes the task.
  if success and prior.error and field ~= 'error' then del[#del + 1] = 'error' end
  -- The reason describes this outcome only (a replayed task may have died before).
  if reason ~= '' then
    set[#set + 1] = 'reason'; set[#set + 1] = reason
  elseif prior.reason then
    del[#del + 1] = 'reason'
  end
  redis.call('HSET', t, unpack(set))
  if #del > 0 then redis.call('HDEL', t, unpack(del)) end
  -- `keep_ms`: the TTL from now, the dedupe mark's lapse included (`ddx`, a window longer than
  -- the status TTL).
  if not prior.ttl_fresh then redis.call('PEXPIRE', t, numstr(prior.keep_ms or ttl_ms)) end
end

-- Submitted again after its dedupe window, its previous run over (`is_final`): a new run of the
-- id (reserve.lua, on a fresh mark). The old record goes — the new run starts from no record, so
-- the worker's claim (start.lua) sees no run record and runs it as attempt 1 — and its kept
-- success (not in the log, see finish.lua) is logged first: the attempt log, which stays, holds
-- the earlier runs' attempts.
function status_resubmitted(id, ttl_ms)
  local t = K_task(id)
  local r = redis.call('HMGET', t, 'state', 'attempt', 'worker', 'started_at', 'finished_at', 'run_base')
  if r[1] == S.succeeded and r[6] then
    log_attempt(id, { attempt = tonumber(r[2]), worker = r[3], started_at = tonumber(r[4]),
      finished_at = tonumber(r[5]), outcome = O.succeeded }, ttl_ms)
  end
  redis.call('DEL', t)
end
-- A fresh submission that writes no waiting status here (no live group matches, or delayed:
-- the scheduler writes that status): the same check as status_waiting's.
-- `cur`: the record's state as the caller read it (nil: read it here).
local function status_renew_if_final(id, ttl_ms, cur)
  if cur == nil then cur = redis.call('HGET', K_task(id), 'state') end
  if is_final(cur) then status_resubmitted(id, ttl_ms) end
end

-- Replayed from the dead-letter queue (dead_claim.lua): the old record goes, and the id is held
-- S.queued under the replay's `token` until the scheduler dispatches the replayed submission —
-- a second replay of the id (another letter, another replica) finds it in flight and refuses.
local function status_replayed(id, token, ttl_ms)
  local t = K_task(id)
  redis.call('DEL', t)
  redis.call('HSET', t, 'state', S.queued, 'replay', token, 'queued_at', NOW_STR)
  redis.call('PEXPIRE', t, ttl_ms)
  -- A new run: indexed now (the newest first in the task list).
  index_run(id, nil)
end

-- Dead outside a worker's outcome (start.lua: R.worker_lost; broker_dead.lua: the broker's
-- reason): the attempt is over and no worker holds it. `fields`: more fields to set (or nil).
local function status_dead(id, reason, err, ttl_ms, fields)
  local t = K_task(id)
  redis.call('HSET', t, 'state', S.dead, 'reason', reason, 'error', err, 'finished_at', NOW_STR, 'run_st', 'done')
  if fields and #fields > 0 then redis.call('HSET', t, unpack(fields)) end
  redis.call('HDEL', t, 'worker')
  redis.call('PEXPIRE', t, ttl_ms)
end

-- Cancelled by an operator (cancel.lua): `by` (the API token's name or role) and `why` (the
-- request's reason) are kept with the time (`at`, Unix ms: when the cancel was accepted, as
-- the control stream records it). The run record stays as it is: a copy that reaches a
-- worker is refused by start.lua on the state alone, and a run going on is the worker's to
-- stop (it learns of the cancel from the control stream) and to end (status_cancel_ended).
-- A reservation the task holds in its group is given back now (its message may wait long
-- before anyone reaches it). `ttl_ms`: the status TTL, from now.
local function status_cancelled(id, by, why, at, ttl_ms, cur)
  local t = K_task(id)
  if cur == S.queued then
    local r = redis.call('HMGET', t, 'group', 'lane', 'key')
    if r[1] and r[2] then redis.call('ZREM', K_resv(r[1], r[2]), id) end
    if r[3] then redis.call('ZREM', K_kq(r[3]), id) end
  end
  redis.call('HSET', t, 'state', S.cancelled, 'cancelled_at', at, 'cancelled_by', by, 'cancel_reason', why,
    'cancelled_from', cur or '')
  redis.call('PEXPIRE', t, ttl_ms)
  -- A mark written back from the control stream after a Redis loss creates the record.
  if not cur then index_run(id, at) end
end

-- The attempt an operator's cancel stopped has ended on worker w (finish.lua): the task stays
-- (or, its mark lost with Redis and known to the worker from the control stream, becomes)
-- cancelled; `done`: this process owns the run record, which then says the attempt is over.
local function status_cancel_ended(id, w, att, done, by, why, ttl_ms)
  local t = K_task(id)
  local set = { 'state', S.cancelled, 'worker', w, 'attempt', att, 'finished_at', NOW_STR }
  if done then set[#set + 1] = 'run_st'; set[#set + 1] = 'done' end
  if by ~= '' then set[#set + 1] = 'cancelled_by'; set[#set + 1] = by end
  if why ~= '' then set[#set + 1] = 'cancel_reason'; set[#set + 1] = why end
  redis.call('HSET', t, unpack(set))
  redis.call('PEXPIRE', t, ttl_ms)
end
