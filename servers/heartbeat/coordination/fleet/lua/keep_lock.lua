
-- A sweep lock kept by its holder only: 1 if ARGV[1] holds KEYS[1] (kept for ARGV[2] ms).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
