-- Records a tick's outcome once and advances the schedule's last-resolved mark.
-- KEYS[1]: the tick's key ({ns}:sk:<schedule>:<tick ms>)
-- KEYS[2]: the schedule's last mark ({ns}:sl:<schedule>)
-- ARGV[1]: outcome, 'fired' or 'missed'
-- ARGV[2]: this replica's id (the tick must be unclaimed or claimed by it)
-- ARGV[3]: the tick, ms since the epoch
-- ARGV[4]: how long the outcome is kept, ms
-- returns: 1 = this call recorded the outcome (count it); 0 = already resolved, or claimed
--          by another replica (which will resolve it)
local v = redis.call('GET', KEYS[1])
if v == 'fired' or v == 'missed' then
  return 0
end
if v and v ~= 'claim:' .. ARGV[2] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if tonumber(ARGV[3]) > last then
  redis.call('SET', KEYS[2], ARGV[3])
end
return 1
