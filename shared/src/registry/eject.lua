-- eject: mark an active worker `ejected` (outlier ejection), unless that would leave its group
-- with no active normal-lane capacity: a group whose every worker fails is better served by
-- its workers than by nobody (Envoy's max ejection percent, at its simplest).
-- KEYS[1]: key prefix
-- ARGV[1]: worker id
-- returns: 1 ejected, 0 refused (the last active capacity of its group), -1 unknown or not active
local wk = K_worker(ARGV[1])
local w = redis.call('HMGET', wk, 'group', 'state', 'cap', 'ccap', 'kinds')
if not w[1] or w[2] ~= 'active' then return -1 end
local cap = tonumber(redis.call('HGET', K_group(w[1]), 'cap:normal') or '0') or 0
if cap - (tonumber(w[3]) or 0) <= 0 then return 0 end
add_capacity(w[1], -contrib('active', w[3]), -contrib('active', w[4]))
redis.call('HSET', wk, 'state', 'ejected')
if has_kind_list(w[5]) then refresh_kinds(w[1]) end
-- An ejected worker stops consuming: its shards go to its peers now (worker.lua hold_ordinal),
-- not only at the worker's own set_state call that follows (which a Redis blip may lose).
hold_ordinal(ARGV[1], w[1], 'ejected')
return 1
