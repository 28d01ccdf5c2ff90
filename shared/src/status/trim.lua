-- trim: removes from the task index (K_tix) the ids whose status record is gone, among its
-- oldest entries (scores up to ARGV[1], Unix ms: older than the status TTL) — a bounded step
-- the scheduler runs periodically (`fleet::status::index`), so the index never outgrows the
-- records. An id whose record still lives (a run that began long ago and is still going, or
-- ended less than a TTL ago) stays.
-- KEYS[1]: key prefix
-- ARGV[1]: oldest score kept unchecked   ARGV[2]: most entries to check
-- returns: {removed, checked}
local r = redis.call('ZRANGE', K_tix(), '-inf', ARGV[1], 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[2]))
local gone = {}
for _, id in ipairs(r) do
  if redis.call('EXISTS', K_task(id)) == 0 then gone[#gone + 1] = id end
end
for k = 1, #gone, 1000 do
  redis.call('ZREM', K_tix(), unpack(gone, k, math.min(k + 999, #gone)))
end
return { #gone, #r }
