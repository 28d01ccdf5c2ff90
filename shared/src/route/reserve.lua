-- reserve: for a batch of tasks, dedupe, choose a group with room and reserve a slot (leased).
-- KEYS[1]: key prefix
-- ARGV[1]: batch token (dedupe marks this call writes say `p:<token>`)   ARGV[2]: reservation lease (ms)
-- ARGV[3]: backlog factor        ARGV[4]: default strategy
-- ARGV[5]: dedupe window (ms)    ARGV[6]: status TTL (ms)
-- ARGV[7]: direct dispatch (1: a normal-lane task only one live group can take is reserved
--          there even beyond its room — no routing choice to protect, and the group's
--          consumers' prefetch bounds what they hold; the scheduler's intake gate counts what
--          waits in the group queue beyond its room. The critical lane, which no gate paces,
--          keeps its room and its small park bound. 0: every task needs room.)
-- ARGV[8]: how long a group's "has parked tasks" flag lives (ms) unless the scheduler's park
--          loop renews it (`park::FLAG_TTL_MS`)
-- ARGV[9]: random seed of this call (the weighted strategy's draws)
-- ARGV[10]: number of paused group lanes p (operator pauses, `fleet::control::PauseSet`), then p
--   entries `<group>|<lane>`: a paused lane is never chosen (nor dispatched to directly); a task
--   only paused lanes could take is answered 'full' naming one of them (it parks there, and its
--   park queue is not released while paused). 0 when nothing is paused.
-- then: fairness keys (tenants, `fleet::control::KeyLimits`): number of keys q, the number of
--   fair park queues per group normal lane F (0: keyed tasks park in the group's one park
--   queue), then per key 5 entries: name, max_running ('' none), rate (tasks/s, '' none),
--   burst, paused ('1' | '0')
-- then: number of distinct selectors m, then per selector: number of pairs n, then n pairs
--   `k=v` (a batch's tasks mostly share a few selectors: each is sent and resolved once)
-- then: number of task descriptions d (0, or the number of tasks), then d pairs: kind,
--   submitted_at (Unix ms, '' unknown) — written into each task's status record with its
--   queued/parked state (keys.lua status_waiting), in the same HSET, with its selector (the
--   selector's pairs joined by ','); the record's first write also indexes the run (K_tix)
-- then: number of tasks, then per task:
--   id, lane, strategy ('' = default), dedupe (0 skip | 1 set-if-absent | 2 redelivered:
--   duplicate only if already handed on),
--   mode (0: new work, 1: released from a park queue, 2: dedupe only — a delayed submission,
--   routed when it is due), selector index (1-based, into the selectors above), kind,
--   key index (1-based, into the keys above; 0: no key)
-- A keyed task is counted against its key, cluster-wide: `kq:<key>` (reserved) and
-- `kr:<key>` (running, start.lua) are leased sets like a group's, so a key's running +
-- reserved is exact across scheduler replicas and no slot outlives its lease (a lapsed lease
-- is not counted; it is dropped here, in one batch in 32 per key at random, and counted: the
-- trailing `reclaimed` figure). A task whose
-- key is paused, at `max_running` or out of rate tokens is answered 'kwait' (it waits without
-- taking any room or token and without setting its group's parked flag: it blocks nobody). A
-- keyed task never goes direct beyond a group's room: it parks, so the release loop can
-- share the room between keys (weighted fair dispatch, `scheduler::park::fair`). A keyed
-- task that parks on the normal lane goes to one of the group's F fair park queues: the
-- key's queue is assigned on first use round robin over the F (hash `fsh:<g>:<lane>`, kept an
-- hour from its last use), so up to F keys waiting in a group never share a queue.
-- A candidate group must match the selector, be live (capacity > 0) and handle the task's
-- kind: its `kinds` field (`*`, missing = `*`, or `a,b`: the kinds every active worker of it
-- handles, kept by the registry scripts — `fleet::registry::Kinds`) is read in the HMGET that
-- reads its capacity, so the kind costs no command per task; a kind no live group handles is
-- answered 'none', exactly like a selector nothing matches.
-- A group with parked tasks (flag `pk:<group>:<lane>`, set here when a task is parked and
-- kept alive by the scheduler's park loop) counts as full for new work, so new tasks queue
-- behind parked ones instead of overtaking them (a single-candidate task too: it parks
-- behind them rather than going direct).
-- returns: per task two entries, answer then group (a flat list: no table per task):
--          'reserved', g (status queued) | 'full', g (matches, no room: park there; status
--          parked) | 'kfull', '<q>|<g>' (a keyed task, no room: park in g's fair queue q, ''
--          for the group's park queue) | 'kwait', '<q>|<g>' (its key is paused, at its limit
--          or out of tokens: park likewise, nothing taken) | 'none', '' (no live group matches and handles the kind) | 'dup', '' (id seen within the
--          window) | 'fresh', '' (mode 2: not a duplicate) | 'cancelled', '' (an operator
--          cancelled it, keys.lua status_cancelled: drop it, never dispatch; nothing reserved)
-- then, after the 2n entries: the number of key slots whose lease lapsed dropped here,
--   then per key of the batch: name, running + reserved after the batch (-1: not read),
--   blocked (1: a task of it was answered 'kwait').
-- The cancel check costs no command on the way to a reservation: the record's state, which
-- the status writer reads anyway, is read once before routing and handed to it.
-- A fresh submission (dedupe 1) of an id whose mark has expired (the window counts from the
-- submission) and whose last run has ended is a new run of the id: keys.lua status_resubmitted.
-- Dedupe marks are fields of the task's status record (`dd`: the mark, `ddx`: when it lapses,
-- Redis ms; the record lives at least as long, keys.lua `write_mark`): no key and no command
-- of their own — the record's one HMGET reads the mark with the state, and the status write
-- that follows carries the new mark in its HSET.
-- Dedupe marks: 'p:<token>' while a submission is being handled, and handed on (confirmed;
-- written just before the scheduler acks the ingress message) either by the batch's flag
-- `ho:<token>` (every submission of the batch handed on: one write per batch) or by the mark
-- becoming 'a' (a batch some of whose publishes failed: its handed-on ids one by one). A mark written by
-- this batch's token is its own (a retry of this very batch after a failed call: Redis keeps
-- what a script wrote before it failed), never a duplicate. A redelivered message (its ack
-- was lost: connection, queue or scheduler failure) is a duplicate only if it was handed on;
-- otherwise it is dispatched again, and the worker's run record (start.lua) makes sure the
-- attempt runs once even if the crashed scheduler had dispatched it too — unless a run record
-- already exists under another batch's mark (a worker claimed the crashed scheduler's copy):
-- then it is a duplicate too, and its status (running, succeeded...) is left as it is.
local now, token, lease, bf = NOW_MS, 'p:' .. ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local default_strategy, dd_ttl, st_ttl = ARGV[4], tonumber(ARGV[5]), ARGV[6]
local direct = ARGV[7] == '1'
-- A batch's shared figures as strings, once (keys.lua NOW_STR: no "%.17g" per task).
local lease_until, mark_until = numstr(now + lease), numstr(now + dd_ttl)
local park_ttl = ARGV[8]
math.randomseed(tonumber(ARGV[9]))
-- Reservations and index entries are deferred and sent once per set (keys.lua `defer`); the
-- batch reads each set (ZCARD) before it adds to it, and counts what it adds itself.
DEFER_INDEX = true

local gcache, ccache = {}, {}
local paused = {}
local npaused = tonumber(ARGV[10])
for j = 1, npaused do paused[ARGV[10 + j]] = true end

-- Drops the lapsed leases of a group lane's reserved and running sets and takes them off its
-- count (once per batch).
local function purge(s)
  s.used = s.used - redis.call('ZREMRANGEBYSCORE', s.resv, '-inf', NOW_STR)
    - redis.call('ZREMRANGEBYSCORE', s.run, '-inf', NOW_STR)
  s.purged = true
end

-- The status a dispatch writes (queued, parked: keys.lua status_queued / status_parked) never
-- hides a claimed attempt.
local function gstate(g, lane)
  local key = g .. '|' .. lane
  local s = gcache[key]
  if s then return s end
  local h = redis.call('HMGET', K_group(g), 'cap:' .. lane, 'room:' .. lane, 'kinds')
  local cap = tonumber(h[1] or '0') or 0
  -- The kinds it handles: nil for every kind, else a set.
  local kinds = nil
  if h[3] and h[3] ~= '*' then
    kinds = {}
    for k in string.gmatch(h[3], '[^,]+') do kinds[k] = true end
  end
  -- Room ahead of the workers: at least capacity × (1 + backlog factor), more for a group that
  -- drains fast (the scheduler writes `room:<lane>` from its completion rate, Little's law).
  s = { cap = cap, used = 0, limit = math.max(cap * (1 + bf), tonumber(h[2] or '0') or 0), health = nil,
    kinds = kinds, paused = paused[key] == true, purged = true }
  if cap > 0 then
    s.resv, s.run = K_resv(g, lane), K_run(g, lane)
    s.used = redis.call('ZCARD', s.resv) + redis.call('ZCARD', s.run)
    s.purged = false
    -- Leases that lapsed (a crash's leftovers) only ever make a group look fuller than it is:
    -- they are dropped when the count says "no room" (is_open), and otherwise in one batch of
    -- 32 at random, so a group that always has room pays no purge per batch and still sheds
    -- its leftovers. Readers of the sets count live leases only (ZCOUNT, oldest_reservation).
    if s.used >= s.limit or math.random() < 1 / 32 then purge(s) end
  end
  gcache[key] = s
  return s
end

local function parked(g, lane, s)
  if s.parked == nil then s.parked = redis.call('EXISTS', K_parked(g, lane)) == 1 end
  return s.parked
end

local function health(g, s)
  if s.health then return s.health end
  local h = redis.call('HGETALL', K_group(g))
  local sum, cnt = 0, 0
  for i = 1, #h, 2 do
    if string.sub(h[i], 1, 2) == 'h:' then sum = sum + (tonumber(h[i + 1]) or 1); cnt = cnt + 1 end
  end
  s.health = (cnt > 0) and math.max(sum / cnt, 0.01) or 1
  return s.health
end

-- The selectors of the batch, each resolved to its sorted candidate groups once.
local sels = {}
-- Fairness keys of the batch: limits, and (read once per key, lazily) the slots it holds
-- and its token bucket.
local nkeys = tonumber(ARGV[11 + npaused])
local fairq = tonumber(ARGV[12 + npaused])
local keys = {}
local reclaimed = 0
do
  local b = 13 + npaused
  for j = 1, nkeys do
    keys[j] = { name = ARGV[b], max = tonumber(ARGV[b + 1]), rate = tonumber(ARGV[b + 2]),
      burst = tonumber(ARGV[b + 3]) or 1, paused = ARGV[b + 4] == '1', dispatched = 0, waiting = 0,
      idx = j }
    b = b + 5
  end
end
-- The slots key ks holds (reserved + running, leases not lapsed), read once per batch: two
-- ZCOUNTs; lapsed entries are not counted and stay until a sweep (ksweep).
local live_from = '(' .. numstr(now)
local function kused(ks)
  if ks.used == nil then
    ks.used = redis.call('ZCOUNT', K_kq(ks.name), live_from, '+inf')
      + redis.call('ZCOUNT', K_kr(ks.name), live_from, '+inf')
  end
  return ks.used
end
-- Drops key ks's lapsed leases (a crash's leftovers), counted in `reclaimed`
-- (`fleet_key_slots_reclaimed_total`): in one batch in 32 per key at random, and when the key
-- is forgotten (control/forget_keys.lua), so the common case costs no command for it.
local function ksweep(ks)
  if ks.swept == nil then
    ks.swept = math.random() < 1 / 32
    if ks.swept then
      reclaimed = reclaimed + redis.call('ZREMRANGEBYSCORE', K_kq(ks.name), '-inf', NOW_STR)
        + redis.call('ZREMRANGEBYSCORE', K_kr(ks.name), '-inf', NOW_STR)
    end
  end
end
local function ktokens(ks)
  if ks.tokens == nil then
    local b = redis.call('HMGET', K_kb(ks.name), 'tokens', 'ts')
    local tok, ts = tonumber(b[1]), tonumber(b[2])
    -- A key's first bucket holds one token: a burst is only what idle time gathered.
    if tok == nil or ts == nil then tok = math.min(1, ks.burst)
    else tok = math.min(ks.burst, tok + math.max(0, now - ts) * ks.rate / 1000) end
    ks.tokens = tok
  end
  return ks.tokens
end
-- Why key ks may not take a slot now (nil: it may).
local function kblocked(ks)
  if ks.paused then return 'paused' end
  if ks.max and kused(ks) >= ks.max then return 'limit' end
  if ks.rate and ktokens(ks) < 1 then return 'rate' end
  return nil
end
-- The fair-queue hashes this batch read (each kept an hour from its last use: renewed once
-- per hash per batch, after the loop, not once per key).
local fshcache, fshkeys = {}, {}
local FSH_AHEAD = 32
-- The fair park queue of key ks in group g's lane ('' for the group's park queue).
local function fair_queue(g, lane, ks)
  if fairq <= 0 or lane ~= 'normal' then return '' end
  local hk = K_fsh(g, lane)
  local c = fshcache[hk]
  if not c then
    c = {}; fshcache[hk] = c
    fshkeys[#fshkeys + 1] = hk
  end
  local q = c[ks.name]
  if q == nil then
    -- Read ahead: this key and up to FSH_AHEAD - 1 keys after it in the batch (the keys are
    -- in order of first task) not read yet in this hash, in one HMGET (false: no queue
    -- assigned yet) — about one command per FSH_AHEAD keys that park here instead of one per
    -- key, and a read never more than FSH_AHEAD fields, whatever the batch's keys.
    local names = {}
    for j = ks.idx, #keys do
      local name = keys[j].name
      if c[name] == nil then
        names[#names + 1] = name
        if #names == FSH_AHEAD then break end
      end
    end
    local got = redis.call('HMGET', hk, unpack(names))
    for j, name in ipairs(names) do c[name] = got[j] end
    q = c[ks.name]
  end
  if not q then
    -- Assigned when the key first waits in this group lane (round robin: up to fairq
    -- waiting keys never share a queue).
    local nth = redis.call('HINCRBY', hk, '#', 1)
    -- A hash this call created gets its TTL at once (a call that fails later must not
    -- leave it without one); every hash touched is renewed after the loop.
    if nth == 1 then redis.call('PEXPIRE', hk, 3600000) end
    q = tostring((nth - 1) % fairq)
    redis.call('HSET', hk, ks.name, q)
    c[ks.name] = q
  end
  return q
end

local nsel = tonumber(ARGV[13 + npaused + 5 * nkeys])
local i = 14 + npaused + 5 * nkeys
for k = 1, nsel do
  local np = tonumber(ARGV[i])
  local pairs_ = {}
  for j = 1, np do pairs_[j] = ARGV[i + j] end
  sels[k] = { pairs = pairs_, key = table.concat(pairs_, ',') }
  i = i + 1 + np
end

local function candidates(k)
  local sel = sels[k]
  local c = ccache[k]
  if c then return c, sel.key end
  if #sel.pairs == 0 then
    c = redis.call('SMEMBERS', K_groups())
  else
    local ks = {}
    for j, pair in ipairs(sel.pairs) do ks[j] = K_idx(pair) end
    c = redis.call('SINTER', unpack(ks))
  end
  table.sort(c)
  ccache[k] = c
  return c, sel.key
end

-- The live candidates (capacity > 0) of selector k on a lane that handle `kind`, as their
-- state tables (each with its group name `g`), resolved once per batch and kind: the per-task
-- loops then touch numbers only.
local lcache, kcache = {}, {}
local function live_groups(k, lane, kind)
  local per = lcache[k]
  if not per then per = {}; lcache[k] = per; kcache[k] = {} end
  local cands, selkey = candidates(k)
  local live = per[lane]
  if not live then
    live = {}
    for _, g in ipairs(cands) do
      local st = gstate(g, lane)
      if st.cap > 0 then st.g = g; live[#live + 1] = st end
    end
    per[lane] = live
    kcache[k][lane] = {}
  end
  local byk = kcache[k][lane]
  local handling = byk[kind]
  if not handling then
    handling = {}
    for _, st in ipairs(live) do
      if st.kinds == nil or st.kinds[kind] then handling[#handling + 1] = st end
    end
    byk[kind] = handling
  end
  return handling, selkey
end

-- Open for a task: not paused, room left, and (new work) no parked tasks to overtake.
local function is_open(st, lane, from_park)
  if st.used >= st.limit and not st.purged then purge(st) end
  return not st.paused and st.used < st.limit and (from_park or not parked(st.g, lane, st))
end

local nd = tonumber(ARGV[i])
local desc = i + 1
i = i + 1 + 2 * nd
local n = tonumber(ARGV[i])
i = i + 1
local out = {}
for t = 1, n do
  local kind, sub = nil, nil
  if nd > 0 then kind, sub = ARGV[desc + 2 * (t - 1)], ARGV[desc + 2 * (t - 1) + 1] end
  local id, lane, strategy, dd = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local from_park, dedupe_only = ARGV[i + 4] == '1', ARGV[i + 4] == '2'
  local selk, kind = tonumber(ARGV[i + 5]), ARGV[i + 6]
  local ks = keys[tonumber(ARGV[i + 7])]
  i = i + 8
  if strategy == '' then strategy = default_strategy end
  local o = 2 * t - 1

  local dup, fresh = false, false
  -- This batch's own mark: a retry of this very call (its first try failed after writing
  -- some statuses, whose deferred index entries went with the error): index again below.
  local own = false
  -- The record, read once: its state (false: none; the cancel check and the status writer),
  -- its dedupe mark (`dd`, live until `ddx`, Redis ms: the mark is a field of the record, so
  -- the check costs no command of its own) and whether a worker claimed it (`run_base`).
  local rec = redis.call('HMGET', K_task(id), 'state', 'dd', 'ddx', 'run_base')
  local cur = rec[1]
  local mark = rec[2]
  if mark and (tonumber(rec[3]) or 0) <= now then mark = false end
  own = mark == token
  if dd == '1' then
    if mark then
      dup = mark ~= token
      -- Its own mark (a retry of this very batch after a failed call): nothing of this
      -- submission has been written beyond the mark, so a final record is an earlier run's.
      fresh = not dup
    else
      -- No mark: new, or the id's window has passed. A run that ended (succeeded, dead,
      -- expired) makes this a new run of the id, not a copy of that one: the status writer
      -- below clears its record. An id still in flight keeps its record, and the worker
      -- takes this copy for a copy of that run. The mark goes with the status write below.
      fresh = true
      MARK = { value = token, until_ms = mark_until, window = dd_ttl }
    end
  elseif dd == '2' then
    if mark == 'a' or (mark and mark ~= token and string.sub(mark, 1, 2) == 'p:'
        and redis.call('EXISTS', K_handed(string.sub(mark, 3))) == 1) then
      -- Handed on: by its own mark, or by its batch's flag (every submission of that batch).
      dup = true
    elseif mark and mark ~= token and rec[4] then
      -- Being handled by another (crashed) scheduler, which handed it on before its mark
      -- said so: a worker has already claimed it. Dispatching it again would only make a
      -- copy for the worker to ack, and writing `queued` would hide the task's true state.
      dup = true
    else
      -- No mark (the window has passed) or this batch's own: as for mode 1, a final record
      -- is an earlier run's and this is a new run of the id — a resubmission after the window
      -- redelivered before its first scheduler acked it is not dropped as a copy. Another
      -- scheduler's mark (it handled this very submission, maybe to a final state it decided
      -- itself, and crashed before acking) is not fresh.
      fresh = (not mark) or mark == token
      MARK = { value = token, until_ms = mark_until, window = dd_ttl }
    end
  end
  if dup then
    out[o], out[o + 1] = 'dup', ''
  elseif dedupe_only then
    if fresh then status_renew_if_final(id, st_ttl, cur) end
    out[o], out[o + 1] = 'fresh', ''
  else
    if cur == S.cancelled and not fresh then
      -- A keyed task cancelled while it waited leaves its key's waiting count.
      if ks and from_park then ks.waiting = ks.waiting - 1 end
      out[o], out[o + 1] = S.cancelled, ''
    else
    local live, selkey = live_groups(selk, lane, kind)
    -- The chosen group and its state table (the tables in `live` are gstate's own).
    local chosen, chosen_st = nil, nil
    local why = ks and #live > 0 and kblocked(ks)
    if why then
      -- Its key may take nothing now: it waits (parked, or held by its release loop) behind
      -- the least loaded unpaused candidate, taking no room.
      local best, bg = nil, live[1].g
      for _, st in ipairs(live) do
        local r = st.used / st.cap
        if not st.paused and (best == nil or r < best) then best = r; bg = st.g end
      end
      if not from_park then
        ks.waiting = ks.waiting + 1
        status_parked(id, bg, lane, st_ttl, kind, sub, fresh, cur, sels[selk].key, ks.name)
      end
      ks.blocked = true
      out[o], out[o + 1] = 'kwait', fair_queue(bg, lane, ks) .. '|' .. bg
    else
    if strategy == 'round_robin' or strategy == 'weighted' then
      local opened = {}
      for _, st in ipairs(live) do
        if is_open(st, lane, from_park) then opened[#opened + 1] = st end
      end
      if #opened > 0 and strategy == 'round_robin' then
        local ctr = redis.call('INCR', K_rr(lane, selkey))
        chosen_st = opened[(ctr % #opened) + 1]
        chosen = chosen_st.g
      elseif #opened > 0 then
        local total, w = 0, {}
        for k, st in ipairs(opened) do
          w[k] = (st.limit - st.used) * health(st.g, st)
          total = total + w[k]
        end
        local x = math.random() * total
        chosen_st = opened[#opened]
        for k, st in ipairs(opened) do
          x = x - w[k]
          if x < 0 then chosen_st = st; break end
        end
        chosen = chosen_st.g
      end
    else
      -- least_loaded: the open group with the lowest share of its capacity in use (no table
      -- per task: this loop runs for every task over every candidate).
      local best = nil
      for _, st in ipairs(live) do
        if is_open(st, lane, from_park) then
          local r = st.used / st.cap
          if best == nil or r < best then best = r; chosen = st.g; chosen_st = st end
        end
      end
    end
    if not chosen and direct and #live == 1 and lane == 'normal' and not ks then
      -- One candidate: no routing choice to protect, so no park hop — unless tasks already
      -- park for it (they keep their place in line).
      local st = live[1]
      if not st.paused and (from_park or not parked(st.g, lane, st)) then chosen = st.g; chosen_st = st end
    end
    if chosen then
      local s = chosen_st or gstate(chosen, lane)
      s.used = s.used + 1
      if not s.resv then s.resv = K_resv(chosen, lane) end
      defer('ZADD', s.resv, lease_until, id)
      if ks then
        -- Counted before the deferred ZADD: kused reads the set as the batch found it. A key
        -- without max_running needs no count (the API counts live leases itself: ZCOUNT)
        -- but in a batch that sweeps it.
        ksweep(ks)
        if ks.max or ks.used ~= nil or ks.swept then ks.used = kused(ks) + 1 end
        defer('ZADD', K_kq(ks.name), lease_until, id)
        ks.leased = true
        if ks.rate then ks.tokens = ktokens(ks) - 1 end
        ks.dispatched = ks.dispatched + 1
        if from_park then ks.waiting = ks.waiting - 1 end
      end
      status_queued(id, chosen, lane, st_ttl, kind, sub, fresh, cur, sels[selk].key, ks and ks.name)
      out[o], out[o + 1] = 'reserved', chosen
    elseif #live > 0 then
      -- The least loaded unpaused candidate frees room first; only when every candidate is
      -- paused does the task park behind a paused one (the first).
      local best, bg = nil, live[1].g
      for _, st in ipairs(live) do
        local r = st.used / st.cap
        if not st.paused and (best == nil or r < best) then best = r; bg = st.g end
      end
      if not from_park then
        -- The flag once per group lane per batch (the same instant, the same TTL): a burst
        -- that parks n tasks in one group costs one SET, not n.
        local pst = gstate(bg, lane)
        if not pst.flagged then
          redis.call('SET', K_parked(bg, lane), '1', 'PX', park_ttl)
          pst.flagged = true
        end
        pst.parked = true
        status_parked(id, bg, lane, st_ttl, kind, sub, fresh, cur, sels[selk].key, ks and ks.name)
        if ks then ks.waiting = ks.waiting + 1 end
      end
      if ks then
        out[o], out[o + 1] = 'kfull', fair_queue(bg, lane, ks) .. '|' .. bg
      else
        out[o], out[o + 1] = 'full', bg
      end
    else
      if fresh then status_renew_if_final(id, st_ttl, cur) end
      out[o], out[o + 1] = 'none', ''
    end
    end
    end
  end
  -- A mark no status write took (a duplicate-free answer without a waiting status: no match,
  -- a delayed submission, a cancelled id, a task already running) is written on its own.
  write_mark(id, st_ttl)
  if own and (out[o] == 'reserved' or out[o] == 'full' or out[o] == 'kfull' or out[o] == 'kwait') then
    index_run(id, sub)
  end
end
flush_deferred()
for _, hk in ipairs(fshkeys) do redis.call('PEXPIRE', hk, 3600000) end
do
  local leased = {}
  for _, ks in ipairs(keys) do
    if ks.leased then leased[#leased + 1] = ks.name end
  end
  keys_leased(leased, lease_until)
end
-- Per key: its bucket, its figures (one hash for every key, read once and written once per
-- batch whatever the number of keys: HMGET of the counters that change, one HSET), and what
-- it holds now.
out[#out + 1] = reclaimed
local fget, fset = {}, {}
for _, ks in ipairs(keys) do
  if ks.tokens ~= nil then
    redis.call('HSET', K_kb(ks.name), 'tokens', tostring(ks.tokens), 'ts', now)
    redis.call('PEXPIRE', K_kb(ks.name), 3600000)
  end
  if ks.dispatched > 0 then fget[#fget + 1] = 'd:' .. ks.name end
  if ks.waiting ~= 0 then fget[#fget + 1] = 'w:' .. ks.name end
  fset[#fset + 1] = 't:' .. ks.name; fset[#fset + 1] = now
  out[#out + 1] = ks.name
  out[#out + 1] = ks.used or -1
  out[#out + 1] = ks.blocked and 1 or 0
end
if #fget > 0 then
  local cur = {}
  for c = 1, #fget, 4000 do
    for _, v in ipairs(redis.call('HMGET', K_kf(), unpack(fget, c, math.min(c + 3999, #fget)))) do
      cur[#cur + 1] = v
    end
  end
  local j = 1
  for _, ks in ipairs(keys) do
    if ks.dispatched > 0 then
      fset[#fset + 1] = fget[j]; fset[#fset + 1] = (tonumber(cur[j]) or 0) + ks.dispatched; j = j + 1
    end
    if ks.waiting ~= 0 then
      -- The waiting count never goes below 0 (a task it counted may have been lost with Redis).
      fset[#fset + 1] = fget[j]; fset[#fset + 1] = math.max(0, (tonumber(cur[j]) or 0) + ks.waiting); j = j + 1
    end
  end
end
for c = 1, #fset, 4000 do redis.call('HSET', K_kf(), unpack(fset, c, math.min(c + 3999, #fset))) end
return out
