-- finish: a worker records the outcomes of task attempts, or releases attempts that ended
-- without one (batch). Called before the deliveries are acked, so an acked task's status is
-- never left `running` by a crash.
-- KEYS[1]: key prefix
-- ARGV[1]: worker id   ARGV[2]: group   ARGV[3]: instance token   ARGV[4]: status TTL (ms)
-- ARGV[5]: number of tasks, then per task:
--   lane, task id, attempt, state (succeeded | retrying | dead | expired | cancelled: the
--   run an operator's cancel stopped, `field` then names who cancelled it and `text` why;
--   '' = release: the
--   attempt ended without an outcome and its delivery went back to the broker; queued =
--   spent: the handler ran, but the broker did not confirm the attempt's retry or dead-letter
--   copy, and its delivery went back — the run record becomes `ran`, so the next copy runs
--   as a new attempt, never this one again: see start.lua),
--   field ('result' | 'error'), text (truncated), success (1 | 0),
--   reason (why dead or expired; '' otherwise)
-- then the worker's task figures, pairs outcome, total (e.g. 'succeeded', 550), published with
--   the batch so `GET /v1/workers` is current (written only while this process holds the
--   worker's registration: a worker that is gone is not re-created)
-- The status is written only if no newer attempt has been recorded (batches of different
-- workers may land out of order); the running record is released regardless. The run record
-- (see start.lua) becomes `done` (later copies of this attempt are duplicates) or `rel`
-- (the next copy runs the same attempt again) — only while this process still owns it.
-- Every outcome (not a release) is appended to the task's attempt log (keys.lua), even one
-- that lands after a newer attempt's: it is that attempt's history — except a success the
-- status record keeps itself (only this script writes `succeeded`, with its worker and times;
-- readers add it from the record, see `fleet::status::attempt_history`), so a task that
-- succeeds at once costs no log key.
-- returns: number of tasks handled
local w, g, inst, st_ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = NOW_MS
local n = tonumber(ARGV[5])
local done = {}
-- The batch's key names, built once (not per task).
local RUN, WRUN = { normal = K_run(g, 'normal'), critical = K_run(g, 'critical') }, K_wrun(w)
for k = 0, n - 1 do
  local b = 6 + 8 * k
  local lane, id, attempt, state = ARGV[b], ARGV[b + 1], tonumber(ARGV[b + 2]), ARGV[b + 3]
  local field, text, success, reason = ARGV[b + 4], ARGV[b + 5], ARGV[b + 6], ARGV[b + 7]
  local t = K_task(id)
  defer('ZREM', RUN[lane] or K_run(g, lane), id)
  defer('SREM', WRUN, lane .. '|' .. id)
  -- Who cancelled and why are read only for a cancelled run (a field that is not there costs
  -- a scan of the whole record).
  local r = redis.call('HMGET', t, 'attempt', 'run_owner', 'run_st', 'worker', 'started_at', 'error', 'reason', 'state', 'key', 'queued_at', 'ddx')
  -- Its fairness key's running entry (a record Redis lost names no key: the entry lapses
  -- with its lease, which no heartbeat renews once the task ended).
  if r[9] then defer('ZREM', K_kr(r[9]), id) end
  local seen = tonumber(r[1] or '0') or 0
  local owned = r[2] == inst and r[3] == 'run'
  if state == S.cancelled then
    -- The run an operator's cancel stopped: never retried, never dead-lettered. Who and why
    -- come from the record (cancel.lua), else from the worker (it read the control stream).
    local c = redis.call('HMGET', t, 'cancelled_by', 'cancel_reason')
    local by, why = c[1] or field, c[2] or text
    local e = { attempt = attempt, worker = w, finished_at = now, outcome = O.cancelled,
      cancelled_by = by, cancel_reason = why }
    if seen == attempt and r[4] == w then e.started_at = tonumber(r[5]) end
    log_attempt(id, e, st_ttl)
    status_cancel_ended(id, w, attempt, owned or r[2] == false, by, why, st_ttl)
  elseif state == '' then
    -- A release leaves a cancelled task cancelled (its next copy is refused by start.lua).
    if owned and r[8] ~= S.cancelled then
      status_requeued(id, 'rel')
    end
  elseif state == S.queued then
    if owned and r[8] ~= S.cancelled then
      status_requeued(id, 'ran')
    end
    log_attempt(id, { attempt = attempt, worker = w, finished_at = now, outcome = O.failed,
      error = 'the run ended, but the broker did not confirm its outcome; the task runs again as a new attempt' }, st_ttl)
  else
    -- Completions per group and lane: the scheduler turns them into each group's room ahead
    -- of its workers (Little's law; see backpressure.rs).
    done[lane] = (done[lane] or 0) + 1
    -- The start time is the record's while it still describes this attempt on this worker.
    local same = seen == attempt and r[4] == w
    -- A success the record itself keeps (worker, start, end: the common case) is not logged:
    -- the API adds it from the record. Every other outcome goes into the log.
    if not (state == S.succeeded and same) then
      local e = { attempt = attempt, worker = w, finished_at = now, outcome = state }
      if state == S.retrying then e.outcome = O.failed end
      if same then e.started_at = tonumber(r[5]) end
      if success ~= '1' and text ~= '' then e.error = text end
      if reason ~= '' then e.reason = reason end
      log_attempt(id, e, st_ttl)
    end
  end
  -- `retrying` only over this attempt's `running` (or a record Redis lost): a late outcome
  -- must not turn the retry copy's own state (queued, parked, delayed) back to `retrying`.
  local retry_ok = state ~= S.retrying or r[8] == S.running or r[8] == false
  if state ~= '' and state ~= S.queued and state ~= S.cancelled and seen <= attempt and r[8] ~= S.cancelled and retry_ok then
    status_finished(id, state, w, attempt, field, text, success == '1', reason, owned or r[2] == false, st_ttl,
      { error = r[6] ~= false, reason = r[7] ~= false,
        ttl_fresh = r[10] and now - (tonumber(r[10]) or 0) < st_ttl / 10,
        keep_ms = math.max(st_ttl, (tonumber(r[11]) or 0) - now) })
  end
end
flush_deferred()
-- Completion counts feed the group's room (Little's law); a group reclaimed meanwhile is not
-- brought back by a late finish.
if redis.call('EXISTS', K_group(g)) == 1 then
  for lane, c in pairs(done) do redis.call('HINCRBY', K_group(g), 'done:' .. lane, c) end
end
local f = 6 + 8 * n
if f < #ARGV and redis.call('HGET', K_worker(w), 'instance') == inst then
  local set = {}
  for i = f, #ARGV - 1, 2 do set[#set + 1] = 'n:' .. ARGV[i]; set[#set + 1] = ARGV[i + 1] end
  redis.call('HSET', K_worker(w), unpack(set))
end
return n
