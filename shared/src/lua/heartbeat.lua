-- heartbeat: a worker's liveness and statistics; renews the leases of its running tasks.
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: instance token   ARGV[3]: (unused, was the client clock)   ARGV[4]: run lease (ms)
-- ARGV[5]: running normal   ARGV[6]: running critical   ARGV[7]: succeeded total
-- ARGV[8]: failed total     ARGV[9]: latency EWMA (ms)  ARGV[10]: CPU utilisation 0..1
-- ARGV[11]: health 0..1 (for weighted routing)
-- ARGV[12..]: running tasks as `lane|task id`
-- returns: the worker's state ('active' | 'draining' | 'ejected'), 'gone' when the
--          registration is missing (Redis lost it: register again), 'conflict' when another
--          instance holds the id
local id, inst, now, lease = ARGV[1], ARGV[2], NOW_MS, tonumber(ARGV[4])
local wk = K_worker(id)
local w = redis.call('HMGET', wk, 'instance', 'group', 'state')
if not w[1] then return 'gone' end
if w[1] ~= inst then return 'conflict' end
local g = w[2]
redis.call('HSET', wk, 'hb', now, 'load', ARGV[5], 'cload', ARGV[6], 'ok', ARGV[7], 'err', ARGV[8],
  'ewma_ms', ARGV[9], 'cpu', ARGV[10])
redis.call('ZADD', K_workers(), now, id)
redis.call('HSET', K_group(g), 'h:' .. id, ARGV[11])
-- Renew only what still runs here: a task listed when the beat was collected may have
-- finished (finish.lua) before this script runs; re-adding it would leak a slot for a lease.
for i = 12, #ARGV do
  local lane, task = string.match(ARGV[i], '^(%a+)|(.*)$')
  if lane then
    local r = redis.call('HMGET', K_task(task), 'run_owner', 'run_st')
    if r[1] == inst and r[2] == 'run' then
      redis.call('ZADD', K_run(g, lane), now + lease, task)
      redis.call('SADD', K_wrun(id), ARGV[i])
    end
  end
end
return w[3]
