-- deregister: a worker leaves (end of drain).
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: instance token (only the owner may deregister)
-- returns: 1 when removed, 0 when not registered or owned by another instance
local inst = redis.call('HGET', K_worker(ARGV[1]), 'instance')
if inst ~= ARGV[2] then return 0 end
return remove_worker(ARGV[1])
