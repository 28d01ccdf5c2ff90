-- dead_lock: renews or releases the dead-queue reader lease (`K_dead_lock`, taken with
-- SET NX PX by `fleet::dead`) only while the caller still holds it.
-- KEYS[1]: key prefix
-- ARGV[1]: holder token   ARGV[2]: lease (ms) to renew for; 0 = release
-- returns: 1 if the caller held the lease, 0 otherwise
local k = K_dead_lock()
if redis.call('GET', k) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) == 0 then
  redis.call('DEL', k)
else
  redis.call('PEXPIRE', k, ARGV[2])
end
return 1
