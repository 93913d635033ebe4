
local owned, lease, members, filters, lock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if redis.call('EXISTS', lease) == 1 or redis.call('SCARD', owned) > 0 then return 0 end
if redis.call('SCARD', KEYS[7]) > 0 then return 0 end  -- persistent sessions it still holds
redis.call('DEL', owned)
redis.call('SREM', members, ARGV[1])
redis.call('HDEL', filters, ARGV[1])
redis.call('DEL', KEYS[6])
if redis.call('GET', lock) == ARGV[2] then redis.call('DEL', lock) end
return 1
