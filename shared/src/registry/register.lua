-- register: add (or re-add) a worker to the registry and its capacity to its group.
-- KEYS[1]: key prefix `{ns}:`
-- ARGV[1]: worker id          ARGV[2]: instance token (random per process)
-- ARGV[3]: group name         ARGV[4]: labels as JSON
-- ARGV[5]: normal capacity    ARGV[6]: critical capacity
-- ARGV[7]: executor kind      ARGV[8]: takeover (1: the previous holder of the id is provably
--   gone — its broker connection, which held the id's exclusive lock queue, has closed)
-- ARGV[9]: liveness window (ms): a different instance seen within it is a live duplicate
-- ARGV[10]: state (active | draining | ejected)
-- ARGV[11]: when this worker last declared its group's queues (server time, ms; 0: the caller
--   declares no queues)
-- ARGV[12]: the task kinds it handles: `*` or `a,b` sorted (`fleet::registry::Kinds`); the
--   group's `kinds` becomes the intersection over its active workers (worker.lua refresh_kinds)
-- ARGV[13..]: label pairs `k=v` for the label index
-- An active worker takes the lowest ordinal free in its group (deterministic subsetting: its
-- ordinal picks the shard queues it consumes); deregister, evict and a move out of `active`
-- (set_state: draining, ejected) free it for the others (`hold_ordinal`).
-- returns: a status word first (a normal reply, never an error reply read back by its text;
--          `RegisterAnswer` in worker.rs parses it): {'registered'}; {'duplicate', <ms>} when
--          another instance heartbeated within the window (<ms> ago); {'reclaiming', <why>}
--          while the group is being reclaimed (its queues are being deleted) or when the
--          worker's queues were declared before the reclaim deleted them (within
--          `RECLAIM_MARGIN_MS` of it, for clock error): declare them again and retry (see
--          reclaim.lua)
local RECLAIM_MARGIN_MS = 1000
local id, inst, g = ARGV[1], ARGV[2], ARGV[3]
local now, window, takeover = NOW_MS, tonumber(ARGV[9]), ARGV[8] == '1'
local rc = redis.call('GET', K_reclaim(g))
if rc == 'pending' then
  return {'reclaiming', 'the group is being reclaimed'}
end
local declared = tonumber(ARGV[11]) or 0
if rc and declared > 0 and declared <= tonumber(rc) + RECLAIM_MARGIN_MS then
  return {'reclaiming', 'the group queues were deleted after this worker declared them'}
end
local wk = K_worker(id)
local old = redis.call('HMGET', wk, 'instance', 'hb')
if not takeover and old[1] and old[1] ~= inst and tonumber(old[2]) and tonumber(old[2]) > now - window then
  return {'duplicate', now - tonumber(old[2])}
end
remove_worker(id)
local state = ARGV[10]
redis.call('HSET', wk, 'id', id, 'instance', inst, 'group', g, 'labels', ARGV[4], 'cap', ARGV[5],
  'ccap', ARGV[6], 'executor', ARGV[7], 'state', state, 'hb', now, 'started', now, 'ok', 0, 'err', 0,
  'load', 0, 'cload', 0, 'ewma_ms', 0, 'cpu', 0, 'kinds', ARGV[12])
hold_ordinal(id, g, state)
redis.call('ZADD', K_workers(), now, id)
redis.call('SADD', K_groups(), g)
redis.call('SADD', K_gw(g), id)
redis.call('HSET', K_group(g), 'labels', ARGV[4], 'h:' .. id, 1)
redis.call('HDEL', K_group(g), 'idle')
for i = 13, #ARGV do redis.call('SADD', K_idx(ARGV[i]), g) end
add_capacity(g, contrib(state, ARGV[5]), contrib(state, ARGV[6]))
if has_kind_list(ARGV[12]) then refresh_kinds(g) end
return {'registered'}
