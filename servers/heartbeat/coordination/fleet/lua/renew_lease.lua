
if redis.call('SET', KEYS[1], ARGV[2], 'XX', 'PX', ARGV[3]) then
  redis.call('SADD', KEYS[2], ARGV[1])
  return 1
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return 0
