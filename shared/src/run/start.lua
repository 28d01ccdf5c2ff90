-- start: a worker claims task attempts before running them (batch). Exactly one run per
-- attempt: the claim is a run record in the task's status hash (`run_base`, `run_owner`,
-- `run_st`, `run_iso`, `attempt`), set only if no live run of that attempt exists.
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: group   ARGV[3]: instance token of this worker process
-- ARGV[4]: run lease (ms)   ARGV[5]: status TTL (ms)
-- ARGV[6]: number of tasks, then per task: lane, task id, base attempt (the envelope's
--   `attempt` + 1: the same for every copy of one delivery), max attempts, isolated (1: this
--   process now runs nothing else; 0 otherwise), fairness key ('' none: a granted run moves
--   the task from the key's reserved set to its running set, leased like the group's)
--
-- A claim of (task, base) against the record:
--   no record, or an older base ............ a new attempt: run it as attempt `base` — unless
--     the record counts that attempt already (attempt >= base, a suspect granted: a peer took
--     the task over after this copy's worker was evicted, and the copy is its late retry): 'dup'
--   a newer base, or this base done ......... a stale or duplicate copy: 'dup' (ack, never run)
--   this base released (no outcome) ......... run again, same attempt number
--   this base ran, outcome not confirmed ..... the handler ran, but the broker did not confirm
--     ('ran')                                 its retry or dead-letter copy (channel lost
--                                             mid-publish, a nack): that attempt is used, so
--     this copy runs as attempt n + 1 — the retry copy, if the broker did take it, then finds
--     attempt n + 1 counted ('dup'); past max_attempts → 'spent' (dead-letter, max_attempts)
--   this base running, owner alive .......... another copy runs (scheduler crash, consumer
--                                             timeout, lost ack): 'wait' until it ends
--   this base running, owner gone ........... its worker died mid-run: a crash is an attempt.
--     crashed while running alone (isolated) and attempts used >= max → 'dead' (worker_lost)
--     otherwise → attempt n + 1, to run isolated ('iso'): a crash beside other tasks does not
--     say which task caused it, so each suspect runs alone until it finishes or crashes alone
--     (the poison-pill detection of Sidekiq Pro's reliable fetch).
-- The batch's set writes (reservations given back, running leases, the worker's running
-- set) are deferred and sent once per set (keys.lua `defer`): a claim of 100 tasks costs
-- one ZREM, one ZADD and one SADD, not 100 of each.
-- An owner is alive while its worker id is registered with the same instance token (eviction
-- and a restarted worker's registration both end that).
-- returns: { 'ok' | 'gone' (the worker's registration is missing: register again), then per
--   task two entries, the answer and its attempt number: 'run', n | 'iso', n | 'wait', 0 |
--   'dup', 0 | 'dlq', n (dead-letter it: worker_lost) | 'spent', n (dead-letter it:
--   max_attempts) | 'cancelled', 0 (an operator cancelled it: ack, never run; its
--   reservation is released here) } (`fleet::run::Claim`)
-- A cancelled task (state S.cancelled, see cancel.lua) is refused before anything else: a
-- copy redelivered after its worker died mid-cancel never runs again elsewhere.
local w, g, inst, lease, st_ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local n = tonumber(ARGV[6])
local now = NOW_MS
local out = { 'ok' }
-- The running leases' score, once (keys.lua numstr).
local lease_until = numstr(now + lease)
if redis.call('HGET', K_worker(w), 'instance') ~= inst then out[1] = 'gone' end

-- `r`: the record as read below (its `state` and `finished_at` tell status_running what to do).
local key = ''
-- The fairness keys this batch leased a run for, each once (K_ka, after the loop).
local leased, leased_seen = {}, {}
-- The batch's key names, built once per lane (not per task).
local RESV, RUN, WRUN = { normal = K_resv(g, 'normal'), critical = K_resv(g, 'critical') },
  { normal = K_run(g, 'normal'), critical = K_run(g, 'critical') }, K_wrun(w)
local function grant(lane, id, t, base, att, iso, r)
  defer('ZREM', RESV[lane] or K_resv(g, lane), id)
  defer('ZADD', RUN[lane] or K_run(g, lane), lease_until, id)
  if key ~= '' then
    defer('ZREM', K_kq(key), id)
    defer('ZADD', K_kr(key), lease_until, id)
    if not leased_seen[key] then leased_seen[key] = true; leased[#leased + 1] = key end
  end
  defer('SADD', WRUN, lane .. '|' .. id)
  status_running(id, g, lane, w, att, base, inst, iso, st_ttl, { exists = r[8] ~= false, finished = r[9] ~= false })
end

-- A crash noticed here (its worker re-registered by another process, or its owner gone while
-- the record still names the worker) goes into the attempt log; an evicted worker's lost
-- attempt was logged by remove_worker, which also removed the worker's name.
local function log_lost(id, att, r)
  if r[6] then
    log_attempt(id, { attempt = att, worker = r[6], started_at = tonumber(r[7]), finished_at = now,
      outcome = O.lost, reason = R.worker_lost }, st_ttl)
  end
end

-- Claims a suspect for this process without running it yet: it runs once the process runs
-- nothing else (re-claimed with isolated = 1).
local function suspect(lane, id, t, att)
  status_suspect(id, w, inst, att, st_ttl)
  defer('SADD', K_wrun(w), lane .. '|' .. id)
  return 'iso', att
end

for k = 0, n - 1 do
  local b = 7 + 6 * k
  local lane, id, base, max, isolated = ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), ARGV[b + 4]
  key = ARGV[b + 5]
  local t = K_task(id)
  -- A first claim (no run record yet: the common case) reads only what it needs; a hash
  -- field that is not there costs a scan of the whole record (listpack), so asking for the
  -- eight run fields of a record that has none cost more than the claim's HSET.
  local r = redis.call('HMGET', t, 'state', 'run_base', 'finished_at')
  if r[2] then
    r = redis.call('HMGET', t, 'run_base', 'run_owner', 'run_st', 'run_iso', 'attempt', 'worker', 'started_at', 'state', 'finished_at')
  else
    r = { false, false, false, false, false, false, false, r[1], r[3] }
  end
  local rb = tonumber(r[1])
  local was_suspect = r[4] == 's' or r[4] == '1'
  local ans, num = nil, 0
  -- A newer base is a new attempt only if the record has not counted that attempt already: a
  -- worker that was evicted (frozen past its heartbeat timeout) and woke may publish a retry
  -- of attempt n after a peer took the task over as attempt n + 1 (a crash suspect) — its
  -- copy carries base n + 1 over run_base n, and would run beside the peer's run (or again
  -- after its success).
  -- A suspect claimed but never granted (run_iso 's') does not count: its claimer may not have
  -- heard the answer (a Redis timeout) and run the copy unchecked under its old number, whose
  -- retry must then run.
  if r[8] == S.cancelled then
    defer('ZREM', K_resv(g, lane), id)
    if key ~= '' then defer('ZREM', K_kq(key), id) end
    ans = S.cancelled
  elseif rb == nil or (rb < base and ((tonumber(r[5]) or 0) < base or r[4] == 's')) then
    -- A newer attempt over a success the record kept (not logged, see finish.lua): log it now.
    if r[8] == S.succeeded and rb ~= nil then
      log_attempt(id, { attempt = tonumber(r[5]), worker = r[6], started_at = tonumber(r[7]),
        finished_at = tonumber(r[9]), outcome = O.succeeded }, st_ttl)
    end
    grant(lane, id, t, base, base, isolated, r)
    ans, num = 'run', base
  elseif rb ~= base or r[3] == 'done' then
    -- A copy (e.g. dispatched again by a scheduler that took over a crashed one's batch, or
    -- the late retry above): the reservation it holds in this group is released with it.
    defer('ZREM', K_resv(g, lane), id)
    if key ~= '' then defer('ZREM', K_kq(key), id) end
    ans = 'dup'
  else
    local att = tonumber(r[5]) or base
    if r[3] == 'rel' then
      -- Released without an outcome (hard stop): the same attempt again, still a suspect if it was.
      if was_suspect and isolated ~= '1' then
        ans, num = suspect(lane, id, t, att)
      else
        grant(lane, id, t, base, att, isolated, r)
        ans, num = 'run', att
      end
    elseif r[3] == 'ran' then
      -- The attempt ran to its end; only its outcome's copy in the broker is unknown. Running
      -- it again under the same number would be a second run of one attempt.
      if att >= max then
        status_dead(id, R.max_attempts, 'its last attempt ran, but the broker did not confirm its outcome', st_ttl)
        ans, num = 'spent', att
      else
        grant(lane, id, t, base, att + 1, isolated, r)
        ans, num = 'run', att + 1
      end
    elseif r[2] == inst then
      if isolated == '1' then
        -- This process claimed it as a suspect and now runs it alone.
        grant(lane, id, t, base, att, '1', r)
        ans, num = 'run', att
      else
        ans = 'wait'
      end
    elseif r[6] and redis.call('HGET', K_worker(r[6]), 'instance') == r[2] then
      ans = 'wait'
    elseif r[4] == 's' then
      -- Claimed as a suspect by a process that died before running it: no charge.
      ans, num = suspect(lane, id, t, att)
    elseif r[4] == '1' and att >= max then
      log_lost(id, att, r)
      status_dead(id, R.worker_lost, 'the worker process died while running this task alone, on its last attempt', st_ttl)
      ans, num = 'dlq', att
    else
      log_lost(id, att, r)
      ans, num = suspect(lane, id, t, att + 1)
    end
  end
  out[#out + 1] = ans
  out[#out + 1] = num
end
flush_deferred()
keys_leased(leased, lease_until)
return out
