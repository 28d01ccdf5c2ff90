-- forget_keys: forgets the fairness keys that went idle (`fleet::Store::forget_idle_keys`).
-- Of the keys named, each not routed since ARGV[1] (its `t:` field in K_kf older, or
-- none), nothing parked waiting (`w:` ≤ 0) and no live lease (none in its kq:/kr: sets,
-- counted only when K_ka scores it at or above now) loses its figures (`t:`, `d:`, `w:` in
-- K_kf), its lapsed leases (its kq:/kr: entries scored below now: the sets vanish when
-- emptied) and its K_ka entry. Then K_ka drops every key scored below now: none of them
-- holds a live lease. So the per-second figures (one HGETALL of K_kf, two ZCOUNTs per key
-- K_ka scores at or above now) cost what the active keys cost, not every key ever seen.
-- A key dispatched to meanwhile is kept: the checks run here, atomically.
-- KEYS[1]: key prefix
-- ARGV[1]: idle since (Redis ms)   ARGV[2..]: keys
-- returns: {keys forgotten, lapsed leases dropped (`fleet_key_slots_reclaimed_total`)}
local since, now = tonumber(ARGV[1]), NOW_MS
local below_now = '(' .. numstr(now)
local gone, dropped = 0, 0
for i = 2, #ARGV do
  local k = ARGV[i]
  local f = redis.call('HMGET', K_kf(), 't:' .. k, 'w:' .. k)
  if (tonumber(f[1]) or 0) < since and (tonumber(f[2]) or 0) <= 0 then
    -- K_ka's score bounds the key's leases from above (a reservation's expiry stays there
    -- after the claim): only a score at or above now needs the sets counted.
    local sc = redis.call('ZSCORE', K_ka(), k)
    sc = sc and tonumber(sc)
    local live = sc and sc >= now and (redis.call('ZCOUNT', K_kq(k), now, '+inf') > 0
      or redis.call('ZCOUNT', K_kr(k), now, '+inf') > 0)
    if not live then
      redis.call('HDEL', K_kf(), 't:' .. k, 'd:' .. k, 'w:' .. k)
      dropped = dropped + redis.call('ZREMRANGEBYSCORE', K_kq(k), '-inf', below_now)
        + redis.call('ZREMRANGEBYSCORE', K_kr(k), '-inf', below_now)
      if sc then redis.call('ZREM', K_ka(), k) end
      gone = gone + 1
    end
  end
end
redis.call('ZREMRANGEBYSCORE', K_ka(), '-inf', below_now)
return { gone, dropped }
