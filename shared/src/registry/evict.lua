-- evict: remove every worker silent for longer than the timeout (health checker).
-- Idempotent, so any number of scheduler replicas may run it.
-- KEYS[1]: key prefix
-- ARGV[1]: heartbeat timeout (ms); the clock is Redis's (NOW_MS, from TIME)
-- returns: the ids of the workers evicted by this call
local stale = redis.call('ZRANGEBYSCORE', K_workers(), '-inf', NOW_MS - tonumber(ARGV[1]))
local out = {}
for _, id in ipairs(stale) do
  if remove_worker(id) == 1 then out[#out + 1] = id end
end
return out
