
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
  -- A session, once ended, never comes back online: a claim is a resend. A re-claim
  -- comes from a node that still holds its connection but was declared lost (cut off
  -- from Redis past its lease): its end is in the history already, so the node closes
  -- the connection (fenced) and the device's next one is a new session.
  if mode == 'reclaim' then return {'ended'} end
  return {}
end
-- Sessions a takeover has ended (the latest few), so that a re-claim of one of them
-- after a failover or a restart does not end it a second time.
local displaced = redis.call('HGET', dev, 'displaced') or ''
local function was_displaced(e)
  for d in string.gmatch(displaced, '%S+') do
    if d == e then return true end
  end
  return false
end
local function displace(e)
  local kept, n = {e}, 1
  for d in string.gmatch(displaced, '%S+') do
    if n >= 4 then break end
    kept[#kept + 1] = d
    n = n + 1
  end
  displaced = table.concat(kept, ' ')
  redis.call('HSET', dev, 'displaced', displaced)
end
local out = {}
-- A session accepted after this one holds the record, or held it and ended: a claim
-- that crossed it on the way loses (the registry's rule), and so does a re-claim from a
-- resynchronisation that comes after it (measured: 130 sessions announced again, and
-- ended twice, by re-claims that found their device's newer session ended already).
local newer = cur_epoch and cur_epoch ~= epoch and tonumber(cur[5] or '0') > tonumber(now)
if newer and (status == 'online' or mode == 'reclaim') then
  if mode == 'reclaim' and not was_displaced(epoch) then
    -- A session announced before Redis lost its record (a failover to a replica
    -- behind, a restart), which a newer one displaced meanwhile without knowing
    -- of it: nobody else will end it, so its end is written here.
    local ended = cjson.decode(ev)
    ended['status'] = 'offline'
    ended['reason'] = 'takeover'
    ended['time'] = tonumber(cur[5])
    ended['silent_for'] = 0
    ended['detail'] = detail
    displace(epoch)
    return {'stale', redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
      'event', cjson.encode(ended), 'origin', me, 'evict', '')}
  end
  return {'stale'}
end
if status == 'online' then
  local old = cjson.decode(cur[4])
  old['status'] = 'offline'
  old['reason'] = 'takeover'
  old['time'] = tonumber(now)
  old['silent_for'] = 0
  old['detail'] = detail
  out[#out + 1] = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'event', cjson.encode(old), 'origin', me, 'evict', cur_owner)
  displace(cur_epoch)
  if cur_owner ~= me then redis.call('SREM', prefix .. 'owned:' .. cur_owner, cid) end
end
redis.call('HSET', dev, unpack(ARGV, 10))
-- Sessions seen of this id (a record of one seen once lives shorter once offline).
redis.call('HINCRBY', dev, 'sessions', 1)
redis.call('PERSIST', dev)
redis.call('SADD', owned, cid)
if mode == 'reclaim' then
  -- Written again for a store that lost the session (a failover, an empty restart):
  -- readers that read the first copy pass over this one.
  out[#out + 1] = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'event', ev, 'origin', me, 'evict', '', 'reclaim', '1')
else
  out[#out + 1] = redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'event', ev, 'origin', me, 'evict', '')
end
return out
