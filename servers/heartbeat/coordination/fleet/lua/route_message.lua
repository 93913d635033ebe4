
for _, key in ipairs(KEYS) do
  redis.call('XADD', key, 'MAXLEN', '~', ARGV[2], '*', 'm', ARGV[1])
  redis.call('PEXPIRE', key, ARGV[3])
end
return #KEYS
