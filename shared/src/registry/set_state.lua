-- set_state: move a worker between active, draining and ejected, adjusting its group's capacity
-- and its subsetting ordinal (held only while active).
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: new state
-- returns: the previous state, or false (nil) when the worker is unknown
-- `draining` is final: a drain asked through the API is never undone by the worker's own
-- writes (an ejection tripping before the worker saw the drain, a heartbeat correcting the
-- state from an older read); the state stays `draining` and the answer says so, and the
-- worker drains. A worker leaves `draining` only by leaving the fleet.
local wk = K_worker(ARGV[1])
local w = redis.call('HMGET', wk, 'group', 'state', 'cap', 'ccap', 'kinds')
if not w[1] then return false end
local old, new = w[2], ARGV[2]
if old == 'draining' then
  hold_ordinal(ARGV[1], w[1], old)
  return old
end
if old ~= new then
  add_capacity(w[1], contrib(new, w[3]) - contrib(old, w[3]), contrib(new, w[4]) - contrib(old, w[4]))
  redis.call('HSET', wk, 'state', new)
  -- Only active workers count in the group's kinds (worker.lua refresh_kinds).
  if has_kind_list(w[5]) then refresh_kinds(w[1]) end
end
-- Only an active worker holds a subsetting ordinal: one that stops consuming hands its shards
-- to its peers at once, one that consumes again takes the lowest free (worker.lua).
hold_ordinal(ARGV[1], w[1], new)
return old
