-- Put before end_session.lua and end_lost_sessions.lua (scripts.py), whose ARGV[8]
-- is "<ttl>,<ttl for an id seen once>" in ms: a record whose device had a single
-- session (a made-up id, most likely) is kept the shorter time once offline.
local ttl_ms, once_ms = string.match(ARGV[8], '^(%-?%d+),(%-?%d+)$')
local ttl, once = tonumber(ttl_ms), tonumber(once_ms)
local function life(dev)
  if ttl <= 0 then return 0 end
  local n = tonumber(redis.call('HGET', dev, 'sessions') or '0')
  if n <= 1 and once > 0 and once < ttl then return once end
  return ttl
end
