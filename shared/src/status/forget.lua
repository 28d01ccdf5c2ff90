-- forget: the status records of tasks whose dead letters an operator deleted
-- (`fleet::broker::dead::delete`): each record that still says dead or expired goes, with its
-- attempt log and its index entry — the task is gone from the task list. A record in any
-- other state (a replay or a new run of the id since) is left.
-- KEYS[1]: key prefix
-- ARGV: the task ids
-- returns: how many records went
local n = 0
-- A dedupe mark still live (`dd`, lapsing at `ddx`: a field of the record) stays, alone in the
-- record until it lapses: a producer's duplicate within the window is still dropped.
for _, id in ipairs(ARGV) do
  local t = K_task(id)
  local r = redis.call('HMGET', t, 'state', 'dd', 'ddx')
  local s = r[1]
  if s == S.dead or s == S.expired then
    redis.call('DEL', t, K_attempts(id))
    redis.call('ZREM', K_tix(), id)
    local left = (tonumber(r[3]) or 0) - NOW_MS
    if r[2] and left > 0 then
      redis.call('HSET', t, 'dd', r[2], 'ddx', r[3])
      redis.call('PEXPIRE', t, left)
    end
    n = n + 1
  end
end
return n
