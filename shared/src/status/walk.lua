-- walk: one step of a walk of the task index (K_tix, newest first), for the task list and
-- bulk actions (`fleet::status::index`). Read-only but for the index itself: an id whose
-- status record is gone (its TTL passed, or Redis lost it) is removed from the index here.
-- KEYS[1]: key prefix
-- ARGV[1]: from score (inclusive, Unix ms)   ARGV[2]: cursor id ('' none: every id at the
--   from score; else only ids below it at that score — the walk's order within one score is
--   by id, descending)   ARGV[3]: down to score (inclusive)   ARGV[4]: most entries to read
-- returns: a flat list, per live entry: id, score, state, group, kind, selector, lane
--   (missing fields as ''), then the last two items are the score and id where the walk
--   stopped ('' '' when it reached the end)
local from, cid, to, max = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local out = {}
local off, read, last_s, last_id = 0, 0, '', ''
local done = false
local gone = {}
while read < max and not done do
  local want = math.min(max - read, 256)
  local r = redis.call('ZRANGE', K_tix(), from, to, 'BYSCORE', 'REV', 'LIMIT', off, want, 'WITHSCORES')
  if #r == 0 then done = true; break end
  off = off + #r / 2
  for k = 1, #r, 2 do
    local id, sc = r[k], r[k + 1]
    if not (cid ~= '' and sc == from and id >= cid) then
      read = read + 1
      local h = redis.call('HMGET', K_task(id), 'state', 'group', 'kind', 'selector', 'lane')
      if h[1] then
        out[#out + 1] = id; out[#out + 1] = sc
        for j = 1, 5 do out[#out + 1] = h[j] or '' end
      else
        gone[#gone + 1] = id
      end
      last_s, last_id = sc, id
    end
  end
  if #r < 2 * want then done = true end
end
if #gone > 0 then redis.call('ZREM', K_tix(), unpack(gone)) end
if done then last_s, last_id = '', '' end
out[#out + 1] = last_s
out[#out + 1] = last_id
return out
