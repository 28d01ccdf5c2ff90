-- decided: the status transitions the scheduler decided for a batch (`fleet::status::Writes`:
-- dead or expired before dispatch, waiting_for_worker, delayed), each through keys.lua's
-- status_decided — never over a final state of the same run, `waiting` only over no record or
-- `waiting` — in one call.
-- KEYS[1]: key prefix
-- ARGV[1]: status TTL (ms)   ARGV[2]: number of records, then per record:
--   id, score (the run's submitted_at, Unix ms; '' unknown), number of fields f, then f pairs
--   field, value (`state` first)
-- returns: a flat list of id, state for every record left as it was (its state was final, or
--   a `waiting` write met another state)
local ttl, n = ARGV[1], tonumber(ARGV[2])
local out = {}
local i = 3
for _ = 1, n do
  local id, score, f = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local set = {}
  for j = 1, 2 * f do set[j] = ARGV[i + 2 + j] end
  i = i + 3 + 2 * f
  local left = status_decided(id, set, ttl, score)
  if left then out[#out + 1] = id; out[#out + 1] = left end
end
return out
