-- Prelude of every fleet script: key layout under the namespace prefix KEYS[1]
-- (`{ns}:`, a Redis Cluster hash tag, so all keys of a fleet share one slot).
-- Mirrors `Names` in shared/src/names.rs; keep both in step.
local P = KEYS[1]
-- One clock for the whole fleet: the Redis server's (leases, heartbeats, eviction, status
-- times), so a process with a skewed clock neither evicts its peers nor expires their work.
local T0 = redis.call('TIME')
local NOW_MS = tonumber(T0[1]) * 1000 + math.floor(tonumber(T0[2]) / 1000)
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
local function K_dedupe(id) return P .. 'dd:' .. id end
local function K_parked(g, lane) return P .. 'pk:' .. g .. ':' .. lane end
local function K_rr(lane, sel) return P .. 'rr:' .. lane .. ':' .. sel end
-- Tombstone of a group being (or just) reclaimed; see reclaim.lua.
local function K_reclaim(g) return P .. 'rc:' .. g end

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

-- A worker adds its capacity to its group only while `active` (draining and ejected
-- workers take nothing new).
local function contrib(state, cap)
  if state == 'active' then return tonumber(cap) or 0 end
  return 0
end

local function add_capacity(g, dn, dc)
  if dn ~= 0 then redis.call('HINCRBY', K_group(g), 'cap:normal', dn) end
  if dc ~= 0 then redis.call('HINCRBY', K_group(g), 'cap:critical', dc) end
end

-- Removes a worker entirely: its capacity, its running records, its index entries.
-- A running record is released only while the task is still this worker's: a task the broker
-- redelivered after this worker died may already run on a peer (its status names the peer),
-- and that record is the peer's. A task this worker was still running goes back to `queued`
-- (the broker hands its delivery to a peer); its run record keeps naming this instance, so the
-- next claim of that attempt sees a lost owner and counts the crash (see start.lua).
-- Idempotent: a second call finds nothing and does nothing.
local function remove_worker(id)
  local wk = K_worker(id)
  local w = redis.call('HMGET', wk, 'group', 'state', 'cap', 'ccap', 'instance', 'ord')
  redis.call('ZREM', K_workers(), id)
  if not w[1] then return 0 end
  local g = w[1]
  -- Free its subsetting ordinal (unless already taken over by another worker).
  if w[6] and redis.call('HGET', K_gord(g), w[6]) == id then redis.call('HDEL', K_gord(g), w[6]) end
  add_capacity(g, -contrib(w[2], w[3]), -contrib(w[2], w[4]))
  for _, m in ipairs(redis.call('SMEMBERS', K_wrun(id))) do
    local lane, task = string.match(m, '^(%a+)|(.*)$')
    if lane then
      local t = redis.call('HMGET', K_task(task), 'worker', 'state', 'run_owner', 'run_st', 'attempt', 'started_at')
      if not t[1] or t[1] == id then redis.call('ZREM', K_run(g, lane), task) end
      if t[1] == id and t[2] == 'running' and t[3] == w[5] and t[4] == 'run' then
        -- The attempt ended without an outcome: lost with its worker (the next claim counts it).
        local ttl = redis.call('PTTL', K_task(task))
        if ttl > 0 then
          log_attempt(task, { attempt = tonumber(t[5]), worker = id, started_at = tonumber(t[6]),
            finished_at = NOW_MS, outcome = 'lost', reason = 'worker_lost' }, ttl)
        end
        redis.call('HSET', K_task(task), 'state', 'queued')
        redis.call('HDEL', K_task(task), 'worker', 'started_at')
      end
    end
  end
  redis.call('DEL', K_wrun(id), wk)
  redis.call('SREM', K_gw(g), id)
  redis.call('HDEL', K_group(g), 'h:' .. id)
  -- The group's last worker left: its reclaim grace starts now (reclaim.lua).
  if redis.call('SCARD', K_gw(g)) == 0 then redis.call('HSET', K_group(g), 'idle', NOW_MS) end
  return 1
end
