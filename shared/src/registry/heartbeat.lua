-- heartbeat: a worker's liveness and statistics; renews the leases of its running tasks.
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: instance token   ARGV[3]: run lease (ms)
-- ARGV[4]: running normal   ARGV[5]: running critical   ARGV[6]: succeeded total
-- ARGV[7]: failed total     ARGV[8]: latency EWMA (ms)  ARGV[9]: CPU utilisation 0..1
-- ARGV[10]: health 0..1 (for weighted routing)
-- ARGV[11..]: running tasks as `lane|task id`, or `lane:key|task id` for a task with a
--   fairness key (its entry in the key's running set is renewed too: after a Redis loss
--   the key's count is rebuilt from the beats within one heartbeat)
-- The clock is Redis's (NOW_MS, from TIME), never the client's.
-- returns: the worker's state ('active' | 'draining' | 'ejected'), 'gone' when the
--          registration is missing (Redis lost it: register again), 'conflict' when another
--          instance holds the id
local id, inst, now, lease = ARGV[1], ARGV[2], NOW_MS, tonumber(ARGV[3])
-- The renewed leases' score, once (keys.lua numstr).
local lease_until = numstr(now + lease)
local wk = K_worker(id)
local w = redis.call('HMGET', wk, 'instance', 'group', 'state')
if not w[1] then return 'gone' end
if w[1] ~= inst then return 'conflict' end
local g = w[2]
redis.call('HSET', wk, 'hb', now, 'load', ARGV[4], 'cload', ARGV[5], 'ok', ARGV[6], 'err', ARGV[7],
  'ewma_ms', ARGV[8], 'cpu', ARGV[9])
redis.call('ZADD', K_workers(), now, id)
redis.call('HSET', K_group(g), 'h:' .. id, ARGV[10])
-- Renew only what still runs here: a task listed when the beat was collected may have
-- finished (finish.lua) before this script runs; re-adding it would leak a slot for a lease.
-- The renewals are deferred: one ZADD/SADD per set per beat (keys.lua defer), whatever the
-- number of running tasks.
-- The fairness keys whose run leases this beat renews, each once (K_ka, after the loop).
local leased, leased_seen = {}, {}
local function lease_of(key)
  if not leased_seen[key] then leased_seen[key] = true; leased[#leased + 1] = key end
end
for i = 11, #ARGV do
  local lane, key, task = string.match(ARGV[i], '^(%a+):?([^|]*)|(.*)$')
  local entry = lane and (lane .. '|' .. task)
  if lane then
    local r = redis.call('HMGET', K_task(task), 'run_owner', 'run_st', 'worker')
    if not r[1] and not r[2] and not r[3] then
      -- No run record at all: Redis lost it (restarted empty) while the task runs here.
      -- Count the run again where a group's load and this worker's running read it (the
      -- views' one source); finish.lua removes both entries whatever the record says.
      defer('ZADD', K_run(g, lane), lease_until, task)
      defer('SADD', K_wrun(id), entry)
      if key ~= '' then defer('ZADD', K_kr(key), lease_until, task); lease_of(key) end
    elseif r[1] == inst and r[2] == 'run' then
      defer('ZADD', K_run(g, lane), lease_until, task)
      defer('SADD', K_wrun(id), entry)
      if key ~= '' then defer('ZADD', K_kr(key), lease_until, task); lease_of(key) end
      if not r[3] then
        -- Still running here after this process was evicted (frozen past the heartbeat
        -- timeout) and registered again: the eviction wrote it back to queued and dropped its
        -- worker. Say it runs, and where: a copy's claim judges the owner alive by that name
        -- (start.lua), and would otherwise run the task beside this run.
        status_resumed(task, id)
      end
    end
  end
end
flush_deferred()
keys_leased(leased, lease_until)
return w[3]
