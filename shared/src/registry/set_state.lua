-- set_state: move a worker between active, draining and ejected, adjusting its group's capacity.
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: new state
-- returns: the previous state, or false (nil) when the worker is unknown
local wk = K_worker(ARGV[1])
local w = redis.call('HMGET', wk, 'group', 'state', 'cap', 'ccap')
if not w[1] then return false end
local old, new = w[2], ARGV[2]
if old ~= new then
  add_capacity(w[1], contrib(new, w[3]) - contrib(old, w[3]), contrib(new, w[4]) - contrib(old, w[4]))
  redis.call('HSET', wk, 'state', new)
end
return old
