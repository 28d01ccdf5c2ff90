-- broker_dead: the status of a task the broker dead-lettered itself (a quorum group queue's
-- delivery limit), written by the scheduler's backstop (scheduler/src/backstop.rs) after the
-- letter is in the dead-letter queue with its reason.
-- KEYS[1]: key prefix
-- ARGV[1]: task id   ARGV[2]: group ('': take it from the status)   ARGV[3]: lane
-- ARGV[4]: reason   ARGV[5]: error text   ARGV[6]: status TTL (ms)
-- An attempt that already ended (run record `done` with a final state: it succeeded, or a
-- worker gave it a fate of its own) keeps its status: the broker's copy was a stale duplicate.
-- Otherwise the task's reservation and running records are released (nobody runs it any more:
-- the broker dead-letters a message only when it comes back) and it is `dead` with the reason.
-- returns: 'dead' (S.dead, the state written) | 'done' (the status was already final, or
--   cancelled: nothing written)
local id, g, lane, reason, err, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local t = K_task(id)
local r = redis.call('HMGET', t, 'state', 'run_st', 'group', 'worker', 'attempt', 'started_at')
if r[2] == 'done' and is_final(r[1]) then return 'done' end
-- A cancelled task stays cancelled (a cancel does not end the run record): its reservation and
-- running records are released, nothing else is written.
if r[1] == S.cancelled then
  if g == '' then g = r[3] or '' end
  if g ~= '' then
    redis.call('ZREM', K_resv(g, lane), id)
    redis.call('ZREM', K_run(g, lane), id)
  end
  if r[4] then redis.call('SREM', K_wrun(r[4]), lane .. '|' .. id) end
  return 'done'
end
if g == '' then g = r[3] or '' end
if g ~= '' then
  redis.call('ZREM', K_resv(g, lane), id)
  redis.call('ZREM', K_run(g, lane), id)
end
if r[4] then redis.call('SREM', K_wrun(r[4]), lane .. '|' .. id) end
-- The attempt log (see keys.lua) records this end too: every attempt that ended is listed.
log_attempt(id, { attempt = tonumber(r[5]), worker = r[4] or nil, started_at = tonumber(r[6]), finished_at = NOW_MS,
  outcome = O.dead, reason = reason, error = err }, ttl)
local fields = { 'lane', lane }
if g ~= '' then fields[3], fields[4] = 'group', g end
status_dead(id, reason, err, ttl, fields)
return S.dead
