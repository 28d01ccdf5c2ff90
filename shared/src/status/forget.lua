-- forget: the status records of tasks whose dead letters an operator deleted
-- (`fleet::broker::dead::delete`): each record that still says dead or expired goes, with its
-- attempt log and its index entry — the task is gone from the task list. A record in any
-- other state (a replay or a new run of the id since) is left.
-- KEYS[1]: key prefix
-- ARGV: the task ids
-- returns: how many records went
local n = 0
for _, id in ipairs(ARGV) do
  local s = redis.call('HGET', K_task(id), 'state')
  if s == S.dead or s == S.expired then
    redis.call('DEL', K_task(id), K_attempts(id))
    redis.call('ZREM', K_tix(), id)
    n = n + 1
  end
end
return n
