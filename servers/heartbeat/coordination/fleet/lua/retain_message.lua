-- ARGV: prefix, topic, payload, head, max bytes, max count, owner, owner's max count,
-- owner's max bytes, expires at (ms, '' for never), now (ms). The stored value is the
-- head (the QoS digit, or a longer head carrying MQTT 5 properties and an expiry; see
-- retained.py) followed by the payload. Each retained message counts against the
-- client that last set it (``retained-owner``: topic -> owner; ``retained-shares``:
-- owner -> messages, and owner .. '\0' -> bytes). A refused message leaves the topic's
-- old one in place. Messages with an MQTT 5 Message Expiry are also in
-- ``retained-expiry`` (score: when, ms); a store that does not fit frees expired ones first.
local h, idx, st = ARGV[1] .. 'retained', ARGV[1] .. 'retained-index', ARGV[1] .. 'retained-stats'
local owners, shares = ARGV[1] .. 'retained-owner', ARGV[1] .. 'retained-shares'
local expiry = ARGV[1] .. 'retained-expiry'
local topic, payload, owner = ARGV[2], ARGV[3], ARGV[7]
local function charge(who, count, size)
  if who == '' then return end
  if redis.call('HINCRBY', shares, who, count) <= 0 then
    redis.call('HDEL', shares, who, who .. '\0')
  else
    redis.call('HINCRBY', shares, who .. '\0', size)
  end
end
local function drop(t)
  local value = redis.call('HGET', h, t)
  if not value then return end
  local size = #t + #value - 1
  charge(redis.call('HGET', owners, t) or '', -1, -size)
  redis.call('HDEL', h, t)
  redis.call('HDEL', owners, t)
  redis.call('ZREM', idx, t)
  redis.call('ZREM', expiry, t)
  redis.call('HINCRBY', st, 'bytes', -size)
end
if payload == '' or (ARGV[10] ~= '' and tonumber(ARGV[10]) <= tonumber(ARGV[11])) then
  drop(topic)
  return 1
end
local size = #topic + #ARGV[4] - 1 + #payload
local function fits()
  local old = redis.call('HGET', h, topic)
  local old_size, old_owner = 0, ''
  if old then
    old_size = #topic + #old - 1
    old_owner = redis.call('HGET', owners, topic) or ''
  end
  local bytes = tonumber(redis.call('HGET', st, 'bytes') or '0')
  local ok
  if old then
    ok = size <= old_size or bytes - old_size + size <= tonumber(ARGV[5])
  else
    ok = redis.call('HLEN', h) < tonumber(ARGV[6]) and bytes + size <= tonumber(ARGV[5])
  end
  return ok, old, old_size, old_owner
end
local ok, old, old_size, old_owner = fits()
if not ok then
  for _, t in ipairs(redis.call('ZRANGE', expiry, '-inf', ARGV[11], 'BYSCORE', 'LIMIT', 0, 256)) do
    drop(t)
  end
  ok, old, old_size, old_owner = fits()
end
if ok and owner ~= '' then
  local held = redis.call('HMGET', shares, owner, owner .. '\0')
  local count, used = tonumber(held[1] or '0'), tonumber(held[2] or '0')
  if old and old_owner == owner then
    ok = size <= old_size or used - old_size + size <= tonumber(ARGV[9])
  else
    ok = count < tonumber(ARGV[8]) and used + size <= tonumber(ARGV[9])
  end
end
if not ok then
  redis.call('HINCRBY', st, 'refused', 1)
  return 0
end
if old then charge(old_owner, -1, -old_size) end
charge(owner, 1, size)
if owner ~= '' then redis.call('HSET', owners, topic, owner) else redis.call('HDEL', owners, topic) end
redis.call('HSET', h, topic, ARGV[4] .. payload)
redis.call('ZADD', idx, 0, topic)
if ARGV[10] ~= '' then
  redis.call('ZADD', expiry, tonumber(ARGV[10]), topic)
else
  redis.call('ZREM', expiry, topic)
end
redis.call('HINCRBY', st, 'bytes', size - old_size)
return 1
