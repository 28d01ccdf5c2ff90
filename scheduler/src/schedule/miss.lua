-- Records every overdue tick of a schedule up to ARGV[2] missed at once: moves the schedule's
-- last mark to it and records that last tick itself `missed` (the older ones keep no per-tick
-- record: they are past their tolerance, nobody claims them).
-- KEYS[1]: the last missed tick's key ({ns}:sk:<schedule>:<tick ms>)
-- KEYS[2]: the schedule's last mark ({ns}:sl:<schedule>)
-- ARGV[1]: this replica's id (the last tick must be unclaimed or claimed by it to be recorded)
-- ARGV[2]: the last missed tick, ms since the epoch
-- ARGV[3]: how long the tick's outcome is kept, ms
-- returns: the last mark before this call (0 for none); the ticks after it up to ARGV[2] were
--          recorded by this call (the caller counts them), none when it is >= ARGV[2]
local prev = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local last = tonumber(ARGV[2])
if prev >= last then
  return prev
end
redis.call('SET', KEYS[2], ARGV[2])
local v = redis.call('GET', KEYS[1])
if not v or v == 'claim:' .. ARGV[1] then
  redis.call('SET', KEYS[1], 'missed', 'PX', ARGV[3])
end
return prev
