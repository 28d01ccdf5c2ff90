-- Claims one tick of a schedule for firing, or renews this replica's claim on it.
-- KEYS[1]: the tick's key ({ns}:sk:<schedule>:<tick ms>)
-- ARGV[1]: this replica's id
-- ARGV[2]: claim lease, ms (a crashed claimant's tick is free again after it)
-- returns: 1 = claimed or renewed by this replica; 0 = claimed by another replica;
--          2 = already resolved (fired or missed)
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], 'claim:' .. ARGV[1], 'PX', ARGV[2])
  return 1
end
if v == 'claim:' .. ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if v == 'fired' or v == 'missed' then
  return 2
end
return 0
