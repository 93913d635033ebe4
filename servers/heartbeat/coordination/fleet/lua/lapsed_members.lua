
local dead = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if m ~= ARGV[2] and redis.call('EXISTS', ARGV[1] .. 'node:' .. m) == 0 then dead[#dead + 1] = m end
end
return dead
