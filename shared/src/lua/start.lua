-- start: a worker turns reservations into running tasks (batch).
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: group   ARGV[3]: now (ms)   ARGV[4]: run lease (ms)
-- ARGV[5]: status TTL (ms)   ARGV[6]: number of tasks, then per task: lane, task id, attempt
-- A start older than the attempt already recorded does not overwrite the status.
-- returns: 'ok', or 'gone' when the worker's registration is missing (register again)
local w, g, now, lease, st_ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local n = tonumber(ARGV[6])
for k = 0, n - 1 do
  local lane, id, attempt = ARGV[7 + 3 * k], ARGV[8 + 3 * k], ARGV[9 + 3 * k]
  redis.call('ZREM', K_resv(g, lane), id)
  redis.call('ZADD', K_run(g, lane), now + lease, id)
  redis.call('SADD', K_wrun(w), lane .. '|' .. id)
  local seen = tonumber(redis.call('HGET', K_task(id), 'attempt') or '0') or 0
  if seen <= tonumber(attempt) then
    redis.call('HSET', K_task(id), 'state', 'running', 'group', g, 'lane', lane, 'worker', w,
      'attempt', attempt, 'started_at', now)
    redis.call('PEXPIRE', K_task(id), st_ttl)
  end
end
if redis.call('EXISTS', K_worker(w)) == 0 then return 'gone' end
return 'ok'
