
-- KEYS: the dead node's lease, the members, the filters, the sweep lock, its route
-- stream, its persistent sessions held, then its owned sets if they share this slot
-- (one Redis; on Redis Cluster each shard's was found empty before, and an empty set
-- is no key at all).
local lease, members, filters, lock = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if redis.call('EXISTS', lease) == 1 then return 0 end
if redis.call('SCARD', KEYS[6]) > 0 then return 0 end  -- persistent sessions it still holds
for i = 7, #KEYS do
  if redis.call('SCARD', KEYS[i]) > 0 then return 0 end
end
redis.call('SREM', members, ARGV[1])
redis.call('HDEL', filters, ARGV[1])
redis.call('DEL', KEYS[5])
if redis.call('GET', lock) == ARGV[2] then redis.call('DEL', lock) end
return 1
