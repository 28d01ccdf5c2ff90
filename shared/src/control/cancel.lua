-- cancel: marks tasks cancelled (an operator's cancel, or the control stream's records applied
-- again after a Redis loss). See `fleet::control`.
-- KEYS[1]: key prefix
-- ARGV[1]: status TTL (ms)
-- ARGV[2]: mode: 'api' (a cancel being accepted: a task with no record is unknown) or
--   'replay' (a record of the control stream: applied to a task with no record too — Redis
--   may have lost it — unless the record is of a later run of the id)
-- ARGV[3]: number of tasks, then per task: id, at (Unix ms: when the cancel was accepted),
--   by (who), reason
-- A task whose record says it ended (succeeded, dead, expired) is left as it is; one already
-- cancelled too (idempotent). In 'replay' mode a record whose `submitted_at` is later than the
-- cancel belongs to a new run of the id (submitted again after its dedupe window): left.
-- returns: per task the state it had before: '' (no record; in 'api' mode nothing was
--   written), or its state word — 'cancelled' for one cancelled before (nothing written),
--   a final state (nothing written), any other (now cancelled); in 'api' mode
--   'same:<state>' when this very cancel (same `at`) was applied first by a control loop,
--   <state> being what it replaced (its `cancelled_from`), or 'same:' when the worker that
--   ran the task ended it first from the stream's record
local st_ttl, mode, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
for k = 0, n - 1 do
  local b = 4 + 4 * k
  local id, at, by, why = ARGV[b], ARGV[b + 1], ARGV[b + 2], ARGV[b + 3]
  local r = redis.call('HMGET', K_task(id), 'state', 'submitted_at', 'cancelled_at', 'cancelled_from')
  local cur = r[1]
  local later_run = mode == 'replay' and r[2] and (tonumber(r[2]) or 0) > (tonumber(at) or 0)
  if mode == 'api' and cur == S.cancelled and (r[3] == at or not r[3]) then
    -- This very record, applied first by a control loop (same `at`: the state it replaced),
    -- or acted on first by the worker that ran the task (its finish wrote `cancelled` with
    -- no mark: the task was running).
    out[#out + 1] = 'same:' .. (r[4] or '')
  elseif cur and (is_final(cur) or later_run) then
    out[#out + 1] = cur
  elseif not cur and mode ~= 'replay' then
    out[#out + 1] = ''
  else
    status_cancelled(id, by, why, at, st_ttl, cur)
    out[#out + 1] = cur or ''
  end
end
return out
