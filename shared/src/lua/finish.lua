-- finish: a worker releases finished tasks and records their outcome (batch).
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: group   ARGV[3]: now (ms)   ARGV[4]: status TTL (ms)
-- ARGV[5]: number of tasks, then per task:
--   lane, task id, attempt, state (succeeded | retrying | dead | expired),
--   field ('result' | 'error'), text (truncated), success (1 | 0),
--   reason (why dead or expired; '' otherwise)
-- The status is written only if no newer attempt has been recorded (batches of different
-- workers may land out of order); the running record is released regardless.
-- returns: number of tasks released
local w, g, now, st_ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n = tonumber(ARGV[5])
local ok, err = 0, 0
for k = 0, n - 1 do
  local b = 6 + 8 * k
  local lane, id, attempt, state = ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 2]), ARGV[b + 3]
  local field, text, success, reason = ARGV[b + 4], ARGV[b + 5], ARGV[b + 6], ARGV[b + 7]
  redis.call('ZREM', K_run(g, lane), id)
  redis.call('SREM', K_wrun(w), lane .. '|' .. id)
  local seen = tonumber(redis.call('HGET', K_task(id), 'attempt') or '0') or 0
  if seen <= attempt then
    redis.call('HSET', K_task(id), 'state', state, 'worker', w, 'finished_at', now, 'attempt', attempt, field, text)
    -- A success after failed attempts: the earlier attempt's error no longer describes the task.
    if success == '1' then redis.call('HDEL', K_task(id), 'error') end
    -- The reason describes this outcome only (a replayed task may have died before).
    if reason ~= '' then redis.call('HSET', K_task(id), 'reason', reason) else redis.call('HDEL', K_task(id), 'reason') end
    redis.call('PEXPIRE', K_task(id), st_ttl)
  end
  if success == '1' then ok = ok + 1 else err = err + 1 end
end
return n
