-- dead_lock: renews or releases the dead-queue reader lease (`deadrd`, taken with
-- SET NX PX by `fleet::broker::dead`) only while the caller still holds it.
-- KEYS[1]: the lease key (`Names::dead_lock`; known up front, so whole — no prelude)
-- ARGV[1]: holder token   ARGV[2]: lease (ms) to renew for; 0 = release
-- returns: 1 if the caller held the lease, 0 otherwise
local k = KEYS[1]
if redis.call('GET', k) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then
  redis.call('DEL', k)
else
  redis.call('PEXPIRE', k, ARGV[2])
end
return 1
