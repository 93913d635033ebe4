
-- KEYS: one shard's presence stream, the dead node's owned set there, and its lease
-- there (on Redis Cluster a copy its renewals keep in every shard): all in one slot.
local stream, owned, lease = KEYS[1], KEYS[2], KEYS[3]
local prefix, me, dead, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local reason, detail, now = ARGV[5], ARGV[6], ARGV[7]
-- life(dev): how long an offline record lives (record_life.lua, put before this).
if ARGV[9] == '1' and redis.call('EXISTS', lease) == 1 then return -1 end
local n = 0
for i = 10, #ARGV do
  local cid = ARGV[i]
  local dev = prefix .. 'dev:' .. cid
  local cur = redis.call('HMGET', dev, 'status', 'owner', 'event')
  if cur[1] == 'online' and cur[2] == dead then
    local e = cjson.decode(cur[3])
    e['status'] = 'offline'
    e['reason'] = reason
    e['time'] = tonumber(now)
    e['silent_for'] = 0
    e['detail'] = detail
    local js = cjson.encode(e)
    redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'event', js, 'origin', me, 'evict', '')
    redis.call('HSET', dev, 'status', 'offline', 'owner', '', 'event', js, 'reason', reason, 'time', now)
    local keep = life(dev)
    if keep > 0 then redis.call('PEXPIRE', dev, keep) end
    n = n + 1
  end
  redis.call('SREM', owned, cid)
end
return n
