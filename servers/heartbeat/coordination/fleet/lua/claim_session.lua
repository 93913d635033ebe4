
local dev, stream, owned = KEYS[1], KEYS[2], KEYS[3]
local prefix, me, cid, epoch, ev = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local maxlen, mode, detail, now = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local cur = redis.call('HMGET', dev, 'status', 'epoch', 'owner', 'event', 'time')
local status, cur_epoch, cur_owner = cur[1], cur[2], cur[3]
if cur_epoch == epoch then
  if status == 'online' then
    if cur_owner == me then redis.call('SADD', owned, cid) end
    return {}
  end
  -- A session, once ended, never comes back online: this is a resend. Only a
  -- resynchronisation re-announces a session still held (declared lost meanwhile).
  if mode ~= 'reclaim' then return {} end
end
local out = {}
if status == 'online' then
  -- Claims from different nodes can cross on the way (the registry's rule): one
  -- accepted before the current owner's loses at once, unpublished.
  if tonumber(cur[5] or '0') > tonumber(now) then
    return {'stale'}
  end
  local old = cjson.decode(cur[4])
  old['status'] = 'offline'
  old['reason'] = 'takeover'
  old['time'] = tonumber(now)
  old['silent_for'] = 0
  old['detail'] = detail
  old['keep_alive'] = nil
  out[#out + 1] = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'event', cjson.encode(old), 'origin', me, 'evict', cur_owner)
  if cur_owner ~= me then redis.call('SREM', prefix .. 'owned:' .. cur_owner, cid) end
end
redis.call('HSET', dev, unpack(ARGV, 10))
-- Sessions seen of this id (a record of one seen once lives shorter once offline).
redis.call('HINCRBY', dev, 'sessions', 1)
redis.call('PERSIST', dev)
redis.call('SADD', owned, cid)
out[#out + 1] = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'event', ev, 'origin', me, 'evict', '')
return out
