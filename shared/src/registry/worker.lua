-- Prelude of the registry's scripts (after names/keys.lua): a worker's capacity in its group
-- and the removal of a worker (deregister, eviction, re-registration). See `fleet::registry`.

-- A worker adds its capacity to its group only while `active` (draining and ejected
-- workers take nothing new).
local function contrib(state, cap)
  if state == 'active' then return tonumber(cap) or 0 end
  return 0
end

local function add_capacity(g, dn, dc)
  if dn ~= 0 then redis.call('HINCRBY', K_group(g), 'cap:normal', dn) end
  if dc ~= 0 then redis.call('HINCRBY', K_group(g), 'cap:critical', dc) end
end

-- The kinds a group handles (`fleet::registry::Kinds`): those every active worker of it
-- handles, written to the group hash's `kinds` field (`*`, or kinds joined by `,` in sorted
-- order; '' when its active workers share none) for the reservation script. A worker whose
-- kinds are `*` never changes the intersection by joining or leaving, so callers refresh only
-- for a worker with a kind list: a fleet of `*` workers never pays for the walk over the group.
local function refresh_kinds(g)
  local set = nil
  for _, w in ipairs(redis.call('SMEMBERS', K_gw(g))) do
    local h = redis.call('HMGET', K_worker(w), 'state', 'kinds')
    if h[1] == 'active' and h[2] and h[2] ~= '*' then
      local mine = {}
      for k in string.gmatch(h[2], '[^,]+') do mine[k] = true end
      if set == nil then
        set = mine
      else
        for k in pairs(set) do if not mine[k] then set[k] = nil end end
      end
    end
  end
  if set == nil then
    redis.call('HSET', K_group(g), 'kinds', '*')
  else
    local list = {}
    for k in pairs(set) do list[#list + 1] = k end
    table.sort(list)
    redis.call('HSET', K_group(g), 'kinds', table.concat(list, ','))
  end
end

-- Whether a worker's kinds (its hash field; missing = `*`) can change its group's.
local function has_kind_list(kinds)
  return kinds ~= nil and kinds ~= false and kinds ~= '*'
end

-- Deterministic subsetting: only an `active` worker holds an ordinal in its group (a draining
-- or ejected worker has cancelled its consumers, so the shards of its subset must go to its
-- peers now — they re-read the ordinal table every heartbeat interval — not when it leaves).
-- An active worker without one takes the lowest free; any other state frees its own (never an
-- ordinal another worker has taken since). Idempotent.
local function hold_ordinal(id, g, state)
  local wk = K_worker(id)
  local ord = redis.call('HGET', wk, 'ord')
  local held = ord and redis.call('HGET', K_gord(g), ord) == id
  if state == 'active' then
    if not held then
      local o = 0
      while redis.call('HSETNX', K_gord(g), o, id) == 0 do o = o + 1 end
      redis.call('HSET', wk, 'ord', o)
    end
  else
    if held then redis.call('HDEL', K_gord(g), ord) end
    if ord then redis.call('HDEL', wk, 'ord') end
  end
end

-- Removes a worker entirely: its capacity, its running records, its index entries.
-- A running record is released only while the task is still this worker's: a task the broker
-- redelivered after this worker died may already run on a peer (its status names the peer),
-- and that record is the peer's. A task this worker was still running goes back to `queued`
-- (the broker hands its delivery to a peer); its run record keeps naming this instance, so the
-- next claim of that attempt sees a lost owner and counts the crash (see start.lua).
-- Idempotent: a second call finds nothing and does nothing.
local function remove_worker(id)
  local wk = K_worker(id)
  local w = redis.call('HMGET', wk, 'group', 'state', 'cap', 'ccap', 'instance', 'ord', 'kinds')
  redis.call('ZREM', K_workers(), id)
  if not w[1] then return 0 end
  local g = w[1]
  -- Free its subsetting ordinal (unless already taken over by another worker).
  if w[6] and redis.call('HGET', K_gord(g), w[6]) == id then redis.call('HDEL', K_gord(g), w[6]) end
  add_capacity(g, -contrib(w[2], w[3]), -contrib(w[2], w[4]))
  for _, m in ipairs(redis.call('SMEMBERS', K_wrun(id))) do
    local lane, task = string.match(m, '^(%a+)|(.*)$')
    if lane then
      local t = redis.call('HMGET', K_task(task), 'worker', 'state', 'run_owner', 'run_st', 'attempt', 'started_at', 'key')
      if not t[1] or t[1] == id then
        redis.call('ZREM', K_run(g, lane), task)
        if t[7] then redis.call('ZREM', K_kr(t[7]), task) end
      end
      if t[1] == id and t[2] == S.running and t[3] == w[5] and t[4] == 'run' then
        -- The attempt ended without an outcome: lost with its worker (the next claim counts it).
        local ttl = redis.call('PTTL', K_task(task))
        if ttl > 0 then
          log_attempt(task, { attempt = tonumber(t[5]), worker = id, started_at = tonumber(t[6]),
            finished_at = NOW_MS, outcome = O.lost, reason = R.worker_lost }, ttl)
        end
        status_requeued(task, nil)
      end
    end
  end
  redis.call('DEL', K_wrun(id), wk)
  redis.call('SREM', K_gw(g), id)
  redis.call('HDEL', K_group(g), 'h:' .. id)
  if has_kind_list(w[7]) then refresh_kinds(g) end
  -- The group's last worker left: its reclaim grace starts now (reclaim.lua).
  if redis.call('SCARD', K_gw(g)) == 0 then redis.call('HSET', K_group(g), 'idle', NOW_MS) end
  return 1
end
