
local h, idx, st = ARGV[1] .. 'retained', ARGV[1] .. 'retained-index', ARGV[1] .. 'retained-stats'
local topic, payload = ARGV[2], ARGV[3]
local old = redis.call('HGET', h, topic)
local old_size = 0
if old then old_size = #topic + #old - 1 end
local function clear()
  if old then
    redis.call('HDEL', h, topic)
    redis.call('ZREM', idx, topic)
    redis.call('HINCRBY', st, 'bytes', -old_size)
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
if not fits then
  clear()
  redis.call('HINCRBY', st, 'refused', 1)
  return 0
end
redis.call('HSET', h, topic, ARGV[4] .. payload)
redis.call('ZADD', idx, 0, topic)
redis.call('HINCRBY', st, 'bytes', size - old_size)
return 1
