-- handed: marks ingress submissions handed on id by id (`fleet::route::dedupe`,
-- `Store::mark_handed_on`, for a batch some of whose publishes failed): each id's dedupe mark
-- becomes 'a' (keys.lua `mark_handed`), and the batch's flag is written when every submission
-- of it was handed on.
-- KEYS[1]: key prefix
-- ARGV[1]: the dedupe window (ms)   ARGV[2]: batch token whose flag `ho:<token>` to write ('':
--   none)   ARGV[3..]: the task ids
-- returns: the number of ids marked
local win = tonumber(ARGV[1])
if ARGV[2] ~= '' then redis.call('SET', K_handed(ARGV[2]), '1', 'PX', win) end
for i = 3, #ARGV do mark_handed(ARGV[i], win) end
return #ARGV - 2
