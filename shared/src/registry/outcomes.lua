-- outcomes: a worker publishes its task figures (user task attempts by outcome) as it
-- records finishes, so `GET /v1/workers` is current, not as of the last heartbeat.
-- KEYS[1]: the worker's hash `w:<id>` (known up front, so whole — no prelude)
-- ARGV[1]: worker id   ARGV[2]: instance token (only the owner writes; a worker that is gone
--          is not re-created)
-- ARGV[3..]: pairs outcome, total (e.g. 'succeeded', 550)
-- returns: 1 when written, 0 when the worker is not registered by this instance
local wk = KEYS[1]
if redis.call('HGET', wk, 'instance') ~= ARGV[2] then return 0 end
for i = 3, #ARGV - 1, 2 do redis.call('HSET', wk, 'n:' .. ARGV[i], ARGV[i + 1]) end
return 1
