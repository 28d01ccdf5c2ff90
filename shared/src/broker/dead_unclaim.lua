-- dead_unclaim: gives back ids a replay claimed (dead_claim.lua) but could not publish: a
-- record still held by this replay's token (nothing has dispatched the id since) is deleted,
-- so the letter, left in the dead queue, can be replayed later.
-- KEYS: the status records `t:<id>` of the ids (`Names::task`; known up front, so whole — no
--   prelude)
-- ARGV[1]: replay token
-- returns: number of records deleted
local token = ARGV[1]
local n = 0
for i = 1, #KEYS do
  local t = KEYS[i]
  if redis.call('HGET', t, 'replay') == token and redis.call('HEXISTS', t, 'group') == 0 then
    n = n + redis.call('DEL', t)
  end
end
return n
