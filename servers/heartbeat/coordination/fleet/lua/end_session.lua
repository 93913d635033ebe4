
local dev, stream, owned = KEYS[1], KEYS[2], KEYS[3]
local prefix, me, cid, epoch, ev = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local maxlen, forget, tomb = ARGV[6], ARGV[7], tonumber(ARGV[9])
-- life(dev): how long an offline record lives (record_life.lua, put before this).
local cur = redis.call('HMGET', dev, 'status', 'epoch', 'owner')
if cur[1] and (cur[2] ~= epoch or cur[1] ~= 'online') then return {} end
local id = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'event', ev, 'origin', me, 'evict', '')
if cur[3] and cur[3] ~= '' and cur[3] ~= me then redis.call('SREM', prefix .. 'owned:' .. cur[3], cid) end
redis.call('SREM', owned, cid)
if forget == '1' then
  -- A tombstone, not nothing: a resent online of this epoch must stay a no-op.
  redis.call('DEL', dev)
  redis.call('HSET', dev, 'status', 'forgotten', 'epoch', epoch)
  redis.call('PEXPIRE', dev, tomb)
else
  redis.call('HSET', dev, unpack(ARGV, 10))
  local keep = life(dev)
  if keep > 0 then redis.call('PEXPIRE', dev, keep) end
end
return {id}
