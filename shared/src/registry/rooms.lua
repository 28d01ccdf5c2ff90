-- rooms: set each group's room ahead of its workers (tasks; see reserve.lua), only for groups
-- that still exist: a sampler's list may be older than a reclaim (reclaim.lua), whose group
-- hash must not come back.
-- KEYS: group hashes `g:<group>` (one per room; a group may repeat; known up front, so whole —
--   no prelude)
-- ARGV: pairs lane, room — the pair i is for KEYS[i]
-- returns: number of rooms written
local n = 0
for i = 1, #KEYS do
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 1 then
    redis.call('HSET', k, 'room:' .. ARGV[2 * i - 1], ARGV[2 * i])
    n = n + 1
  end
end
return n
