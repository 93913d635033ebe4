
-- ARGV: prefix, topic, payload, qos, max bytes, max count, owner, owner's max count,
-- owner's max bytes. Each retained message counts against the client that last set it
-- (``retained-owner``: topic -> owner; ``retained-shares``: owner -> messages, and
-- owner .. '\0' -> bytes). A refused message leaves the topic's old one in place.
local h, idx, st = ARGV[1] .. 'retained', ARGV[1] .. 'retained-index', ARGV[1] .. 'retained-stats'
local owners, shares = ARGV[1] .. 'retained-owner', ARGV[1] .. 'retained-shares'
local topic, payload, owner = ARGV[2], ARGV[3], ARGV[7]
local old = redis.call('HGET', h, topic)
local old_size = 0
if old then old_size = #topic + #old - 1 end
local old_owner = redis.call('HGET', owners, topic) or ''
local function charge(who, count, size)
  if who == '' then return end
  if redis.call('HINCRBY', shares, who, count) <= 0 then
    redis.call('HDEL', shares, who, who .. '\0')
  else
    redis.call('HINCRBY', shares, who .. '\0', size)
  end
end
local function clear()
  if old then
    redis.call('HDEL', h, topic)
    redis.call('HDEL', owners, topic)
    redis.call('ZREM', idx, topic)
    redis.call('HINCRBY', st, 'bytes', -old_size)
    charge(old_owner, -1, -old_size)
  end
end
if payload == '' then
  clear()
  return 1
end
local size = #topic + #payload
local bytes = tonumber(redis.call('HGET', st, 'bytes') or '0')
local fits
if old then
  fits = size <= old_size or bytes - old_size + size <= tonumber(ARGV[5])
else
  fits = redis.call('HLEN', h) < tonumber(ARGV[6]) and bytes + size <= tonumber(ARGV[5])
end
if fits and owner ~= '' then
  local held = redis.call('HMGET', shares, owner, owner .. '\0')
  local count, used = tonumber(held[1] or '0'), tonumber(held[2] or '0')
  if old and old_owner == owner then
    fits = size <= old_size or used - old_size + size <= tonumber(ARGV[9])
  else
    fits = count < tonumber(ARGV[8]) and used + size <= tonumber(ARGV[9])
  end
end
if not fits then
  redis.call('HINCRBY', st, 'refused', 1)
  return 0
end
if old then charge(old_owner, -1, -old_size) end
charge(owner, 1, size)
if owner ~= '' then redis.call('HSET', owners, topic, owner) else redis.call('HDEL', owners, topic) end
redis.call('HSET', h, topic, ARGV[4] .. payload)
redis.call('ZADD', idx, 0, topic)
redis.call('HINCRBY', st, 'bytes', size - old_size)
return 1
