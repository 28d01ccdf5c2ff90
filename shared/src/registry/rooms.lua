-- rooms: set each group's room ahead of its workers (tasks; see reserve.lua), only for groups
-- that still exist: a sampler's list may be older than a reclaim (reclaim.lua), whose group
-- hash must not come back.
-- KEYS[1]: key prefix   KEYS[2..]: group hashes `g:<group>` (one per room; a group may repeat)
-- ARGV: pairs lane, room — the pair i is for KEYS[i + 1]
-- returns: number of rooms written
local n = 0
for i = 2, #KEYS do
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 1 then
    redis.call('HSET', k, 'room:' .. ARGV[2 * i - 3], ARGV[2 * i - 2])
    n = n + 1
  end
end
return n
