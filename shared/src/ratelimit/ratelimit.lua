-- ratelimit: GCRA token bucket shared by every scheduler replica; takes up to N tokens.
-- KEYS[1]: the bucket key (theoretical arrival time, microseconds)
-- ARGV[1]: rate (tokens per second)   ARGV[2]: burst (tokens)   ARGV[3]: tokens wanted
-- returns: { tokens granted, milliseconds until the next token when not all were granted }
-- Time is the Redis server's (TIME), so replicas with skewed clocks share one bucket.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = 1000000 / tonumber(ARGV[1])
local burst, want = tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or now) or now
if tat < now then tat = now end
local ceiling = now + burst * interval
local room = math.floor((ceiling - tat) / interval)
local granted = math.max(0, math.min(want, room))
if granted > 0 then
  tat = tat + granted * interval
  redis.call('SET', KEYS[1], string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
end
local wait = 0
if granted < want then wait = math.ceil(math.max(0, tat + interval - ceiling) / 1000) end
return { granted, wait }
