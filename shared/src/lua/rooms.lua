-- rooms: set each group's room ahead of its workers (tasks; see reserve.lua), only for groups
-- that still exist: a sampler's list may be older than a reclaim (reclaim.lua), whose group
-- hash must not come back.
-- KEYS[1]: key prefix
-- ARGV: triples group, lane, room
-- returns: number of groups written
local n = 0
for i = 1, #ARGV, 3 do
  local k = K_group(ARGV[i])
  if redis.call('EXISTS', k) == 1 then
    redis.call('HSET', k, 'room:' .. ARGV[i + 1], ARGV[i + 2])
    n = n + 1
  end
end
return n
