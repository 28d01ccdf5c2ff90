-- dead_claim: claims task ids for a dead-letter replay, one replay of an id at a time across
-- every process (two letters of one id, or two replicas replaying at once, must not run it
-- twice).
-- KEYS[1]: key prefix
-- ARGV[1]: replay token (this replay's)   ARGV[2]: status TTL (ms)   ARGV[3..]: task ids
-- An id is claimed when its status record is absent or final (succeeded, dead, expired): its
-- dedupe mark (a field of the record) goes with the old record (the replayed submission is fresh) and its record becomes S.queued
-- under the token (keys.lua status_replayed) until the scheduler dispatches it. An id in
-- flight (any other state: a replay already resubmitted it, or the producer did) is refused,
-- and so is one whose record is another replay's run that succeeded within the dedupe window.
-- returns: per id, 'ok' or the state that refused it
local token, ttl = ARGV[1], ARGV[2]
local out = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  local r = redis.call('HMGET', K_task(id), 'state', 'replay', 'ddx')
  local st = r[1]
  if st and not is_final(st) then
    out[#out + 1] = st
  elseif st == S.succeeded and r[2] and r[2] ~= token and (tonumber(r[3]) or 0) > NOW_MS then
    -- The run of another replay, succeeded within its dedupe window: this letter is a copy
    -- (two letters of one id replayed one after the other by two replicas). A replay that
    -- died again may be replayed at once.
    out[#out + 1] = st
  else
    status_replayed(id, token, ttl)
    out[#out + 1] = 'ok'
  end
end
return out
