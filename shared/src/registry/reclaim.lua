-- reclaim: remove a departed group — no worker, no running, reserved or parked record — once it
-- has been empty for a grace, in three steps around the scheduler deleting its queues.
-- KEYS[1]: key prefix
-- ARGV[1]: step: 'claim' | 'done' | 'restore' | 'restore_undeclared'
-- ARGV[2]: group
-- ARGV[3]: claim: the grace (ms) | restore, restore_undeclared: the group's labels as JSON (what
--   claim returned)
-- ARGV[4]: life of the tombstone `rc:<group>` (ms)
--
-- claim: atomic against a worker registering: while the group has a worker (or running,
--   reserved or parked work) nothing is removed and the grace starts again when it is empty.
--   The grace is measured from `idle` (server time, set when its last worker left, see
--   keys.lua; set here for a group found empty without it). Past the grace: the group's keys
--   go (its hash, workers set, reservation, running and parked keys, its label-index entries,
--   its name in the groups set) and the tombstone `rc:<group>` = 'pending' is set: register.lua
--   refuses the group while its queues are being deleted.
--   returns { 'reclaimed', labels JSON } | { 'wait', ms left } | { 'busy', why } | { 'absent', '' }
-- done: the queues are deleted; the tombstone becomes the time the deletion ended, so a worker
--   whose queue declaration is older (its queues were deleted under it) must declare them again
--   before it registers. returns { 'done', time ms }
-- restore: a queue held a task after all (work arrived): the group comes back, its grace starts
--   again. returns { 'restored', '' }
-- restore_undeclared: the same, but the scheduler could not declare the group's queues again
--   (some may be unbound or deleted): the tombstone becomes the time of now, as in done, so a
--   worker of the group declares (and binds) them again before it registers.
local step, g = ARGV[1], ARGV[2]
local hold = tonumber(ARGV[4])
local rc = K_reclaim(g)

local function index(labels, add)
  local ok, t = pcall(cjson.decode, labels or '{}')
  if not ok or type(t) ~= 'table' then return end
  for k, v in pairs(t) do
    if add then redis.call('SADD', K_idx(k .. '=' .. v), g) else redis.call('SREM', K_idx(k .. '=' .. v), g) end
  end
end

if step == 'done' then
  if redis.call('GET', rc) == 'pending' then redis.call('SET', rc, NOW_MS, 'PX', hold) end
  return { 'done', tostring(NOW_MS) }
end

if step == 'restore' or step == 'restore_undeclared' then
  redis.call('SADD', K_groups(), g)
  redis.call('HSET', K_group(g), 'labels', ARGV[3], 'idle', NOW_MS)
  index(ARGV[3], true)
  if step == 'restore' then
    redis.call('DEL', rc)
  else
    redis.call('SET', rc, NOW_MS, 'PX', hold)
  end
  return { 'restored', '' }
end

-- claim
if redis.call('SISMEMBER', K_groups(), g) == 0 then return { 'absent', '' } end
if redis.call('GET', rc) == 'pending' then return { 'busy', 'being reclaimed' } end
local gk = K_group(g)
if redis.call('SCARD', K_gw(g)) > 0 then
  redis.call('HDEL', gk, 'idle')
  return { 'busy', 'workers' }
end
local h = redis.call('HMGET', gk, 'cap:normal', 'cap:critical', 'idle', 'labels')
if (tonumber(h[1]) or 0) > 0 or (tonumber(h[2]) or 0) > 0 then return { 'busy', 'capacity' } end
for _, lane in ipairs({ 'normal', 'critical' }) do
  -- Expired leases count for nothing (their holders are gone); live ones keep the group.
  redis.call('ZREMRANGEBYSCORE', K_resv(g, lane), '-inf', NOW_MS)
  redis.call('ZREMRANGEBYSCORE', K_run(g, lane), '-inf', NOW_MS)
  if redis.call('ZCARD', K_resv(g, lane)) > 0 then return { 'busy', 'reserved' } end
  if redis.call('ZCARD', K_run(g, lane)) > 0 then return { 'busy', 'running' } end
  if redis.call('EXISTS', K_parked(g, lane)) == 1 then return { 'busy', 'parked' } end
end
local idle = tonumber(h[3])
if not idle then
  redis.call('HSET', gk, 'idle', NOW_MS)
  return { 'wait', ARGV[3] }
end
local left = idle + tonumber(ARGV[3]) - NOW_MS
if left > 0 then return { 'wait', tostring(left) } end
index(h[4], false)
for _, lane in ipairs({ 'normal', 'critical' }) do
  redis.call('DEL', K_resv(g, lane), K_run(g, lane), K_parked(g, lane))
end
redis.call('DEL', gk, K_gw(g))
redis.call('SREM', K_groups(), g)
redis.call('SET', rc, 'pending', 'PX', hold)
return { 'reclaimed', h[4] or '{}' }
