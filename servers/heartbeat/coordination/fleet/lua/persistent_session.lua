
local prefix, me, op = ARGV[1], ARGV[2], ARGV[3]
-- ARGV[4]: the window's messages, then, if its payload bytes are bounded, '/' and the
-- bound ('20/4096'), so that every other argument keeps its place.
local window_arg, max_queued = ARGV[4], tonumber(ARGV[5])
local window = tonumber(window_arg:match('^%d+'))
local window_bytes = tonumber(window_arg:match('/(%d+)$') or '0')
local max_qbytes, total_max = tonumber(ARGV[6]), tonumber(ARGV[7])
local expiry, route_max, route_ttl, notice_max = tonumber(ARGV[8]), ARGV[9], ARGV[10], ARGV[11]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local stats, sessions = prefix .. 'pstats', prefix .. 'psessions'

local function key(kind, name) return prefix .. kind .. ':' .. name end

-- MQTT packets, as servers.heartbeat.encoders writes them.
local function varlen(n)
  local out = ''
  repeat
    local byte = n % 128
    n = math.floor(n / 128)
    if n > 0 then byte = byte + 128 end
    out = out .. string.char(byte)
  until n == 0
  return out
end
-- ``props``: an MQTT 5 session's (packed, as servers.heartbeat.v5.outbound writes them);
-- nil writes 3.1.1.
local function publish(topic, payload, qos, retain, pid, dup, props)
  local first = 48 + qos * 2 + retain
  if dup then first = first + 8 end
  local body = struct.pack('>H', #topic) .. topic .. struct.pack('>H', pid)
  if props then body = body .. varlen(#props) .. props end
  body = body .. payload
  return string.char(first) .. varlen(#body) .. body
end
local function pubrel(pid) return string.char(98, 2) .. struct.pack('>H', pid) end

-- Whether a session's client last spoke MQTT 5.0: its packets are written so.
local function speaks5(cid) return redis.call('HGET', key('ps', cid), 'v5') == '1' end

-- MQTT 5's Message Expiry Interval, counted down (§3.3.2.3.3). The properties are in
-- the spec's order, so it is first, or second behind a Payload Format Indicator.
local function expiry_at(props)
  if props:byte(1) == 2 then return 2 end
  if props:byte(1) == 1 and props:byte(3) == 2 then return 4 end
  return nil
end
-- ``props`` as sent ``now``, for a message taken at ``born`` (ms); nil once it has run
-- out, unless ``resend`` (a delivery begun is completed, with a second left at least).
local function counted(props, born, resend)
  local at = expiry_at(props)
  if not at or not born or born == 0 then return props end
  local lifetime = struct.unpack('>I4', props, at)
  local left = lifetime - math.floor((now - born) / 1000)
  if left <= 0 then
    if not resend then return nil end
    left = 1
  end
  if left > lifetime then left = lifetime end
  return props:sub(1, at - 1) .. struct.pack('>I4', left) .. props:sub(at + 4)
end

-- Packets for the connection ``holder`` of a session, held on ``node`` (``v`` says
-- whether they are written for MQTT 5.0).
local function send(cid, holder, node, packets)
  if #packets == 0 or node == '' then return end
  local stream = prefix .. 'route:' .. node
  local v = speaks5(cid) and '1' or '0'
  redis.call('XADD', stream, 'MAXLEN', '~', route_max, '*', 'c', cid, 'e', holder, 'p', table.concat(packets), 'v', v)
  redis.call('PEXPIRE', stream, route_ttl)
end

-- Payload bytes in flight: ps:<cid> 'fb', kept as messages go and are acknowledged
-- (recounted at each attach). Not added when 0: Lua may write -0, which HINCRBY refuses.
local function flying(s, n)
  if n ~= 0 then redis.call('HINCRBY', s, 'fb', n) end
end

-- Whether the window takes one more message: fewer than ``window`` in flight and, if
-- bounded, payload bytes in flight below ``window_bytes``, as Mosquitto's
-- db__ready_for_flight (servers.heartbeat.broker.outbox.Outbox.admits): the message is
-- not weighed first, so one always goes when none is in flight.
local function admits(cid)
  if redis.call('HLEN', key('pfl', cid)) >= window then return false end
  if window_bytes == 0 then return true end
  return tonumber(redis.call('HGET', key('ps', cid), 'fb') or '0') < window_bytes
end

-- In flight: pfl:<cid> id -> msgpack {seq, qos, retain, stage (1 sent, 2 released),
-- topic, payload, props, born}. ``props`` and ``born`` (ms) are an MQTT 5 message's.
local function launch(cid, qos, retain, topic, payload, props, born)
  local s, fl = key('ps', cid), key('pfl', cid)
  local id = tonumber(redis.call('HGET', s, 'lastid') or '0')
  repeat id = id % 65535 + 1 until redis.call('HEXISTS', fl, id) == 0
  local seq = redis.call('HINCRBY', s, 'seq', 1)
  redis.call('HSET', s, 'lastid', id)
  flying(s, #payload)
  redis.call('HSET', fl, id, cmsgpack.pack({seq, qos, retain, 1, topic, payload, props or '', born or 0}))
  local sent = nil
  if speaks5(cid) then sent = counted(props or '', born, true) end
  return publish(topic, payload, qos, retain, id, false, sent)
end

-- Queued: pq:<cid> msgpack {qos, retain, topic, payload, props, born}; moved into the
-- window while it has room (one whose Message Expiry ran out meanwhile is deleted).
local function fill(cid, packets)
  local q, fl = key('pq', cid), key('pfl', cid)
  local freed = 0
  while admits(cid) do
    local raw = redis.call('LPOP', q)
    if not raw then break end
    local m = cmsgpack.unpack(raw)
    freed = freed + #m[3] + #m[4]
    if m[5] and m[5] ~= '' and not counted(m[5], m[6], false) then
      redis.call('HINCRBY', stats, 'messages_expired', 1)
    else
      packets[#packets + 1] = launch(cid, m[1], m[2], m[3], m[4], m[5], m[6])
    end
  end
  if freed > 0 then
    redis.call('HINCRBY', key('ps', cid), 'qb', -freed)
    redis.call('HINCRBY', stats, 'queued_bytes', -freed)
  end
  return packets
end

-- -1: dropped, the session's first drop (logged once); -2: dropped again.
local function drop(s)
  redis.call('HINCRBY', stats, 'dropped', 1)
  if redis.call('HSETNX', s, 'dropping', '1') == 1 then return -1 end
  return -2
end

-- One message for one session: 1 sent, 2 queued, 0 no such session, < 0 dropped.
local function push(cid, qos, retain, topic, payload, props)
  local s, q = key('ps', cid), key('pq', cid)
  local cur = redis.call('HMGET', s, 'holder', 'hnode', 'qb')
  if not cur[1] then return 0 end
  local size = #topic + #payload
  props = props or ''
  local born = 0
  if expiry_at(props) then born = now end
  if cur[1] ~= '' then
    if redis.call('LLEN', q) == 0 and admits(cid) then
      send(cid, cur[1], cur[2], {launch(cid, qos, retain, topic, payload, props, born)})
      return 1
    end
  elseif tonumber(redis.call('HGET', stats, 'queued_bytes') or '0') + size > total_max then
    return drop(s)
  end
  if redis.call('LLEN', q) >= max_queued or tonumber(cur[3]) + size > max_qbytes then return drop(s) end
  redis.call('RPUSH', q, cmsgpack.pack({qos, retain, topic, payload, props, born}))
  redis.call('HINCRBY', s, 'qb', size)
  redis.call('HINCRBY', stats, 'queued_bytes', size)
  return 2
end

-- The fleet-wide set of persistent filters: pf:<filter> cid -> qos, pfilters filter -> sessions.
local function notice(f, on)
  local v = redis.call('INCR', prefix .. 'pfilters-version')
  redis.call('XADD', prefix .. 'pfilters-changed', 'MAXLEN', '~', notice_max, '*', 'f', f, 'on', on, 'v', v)
end
local function index(f, cid, qos)
  if redis.call('HSET', key('pf', f), cid, qos) == 1 and redis.call('HINCRBY', prefix .. 'pfilters', f, 1) == 1 then
    notice(f, '1')
  end
end
local function unindex(f, cid)
  if redis.call('HDEL', key('pf', f), cid) == 1 and redis.call('HINCRBY', prefix .. 'pfilters', f, -1) <= 0 then
    redis.call('HDEL', prefix .. 'pfilters', f)
    notice(f, '0')
  end
end

local function discard(cid)
  local s = key('ps', cid)
  local cur = redis.call('HMGET', s, 'hnode', 'qb')
  redis.call('ZREM', sessions, cid)
  if not cur[1] then return 0 end
  for _, f in ipairs(redis.call('HKEYS', key('psub', cid))) do unindex(f, cid) end
  -- Not -tonumber(qb) alone: Lua writes -0 for an empty queue, which HINCRBY refuses.
  local qb = tonumber(cur[2]) or 0
  if qb ~= 0 then redis.call('HINCRBY', stats, 'queued_bytes', -qb) end
  if cur[1] ~= '' then redis.call('SREM', prefix .. 'pheld:' .. cur[1], cid) end
  redis.call('DEL', s, key('psub', cid), key('psubo', cid), key('pin', cid), key('pfl', cid), key('pq', cid))
  return 1
end

-- A session ended by its expiry: what it held for its client goes with it, counted.
local function expire(cid)
  local held = redis.call('LLEN', key('pq', cid)) + redis.call('HLEN', key('pfl', cid))
  if held > 0 then redis.call('HINCRBY', stats, 'expired_messages', held) end
  redis.call('HINCRBY', stats, 'expired', 1)
  return discard(cid)
end

-- The session's own expiry (ms): its client's last connection's, else the fleet's.
local function expiry_of(s)
  return tonumber(redis.call('HGET', s, 'exp') or '') or expiry
end

-- Its connection ended: the session waits its expiry for the client, or ends now if 0.
local function detach(cid, s, node)
  redis.call('HSET', s, 'holder', '', 'hnode', '', 'left', now)
  redis.call('SREM', prefix .. 'pheld:' .. node, cid)
  local exp = expiry_of(s)
  if exp <= 0 then return expire(cid) end
  redis.call('ZADD', sessions, now + exp, cid)
  return 0
end

-- The holder changes: resend what is in flight (DUP; PUBREL past PUBREC), in send order, then fill.
local function attach(cid, epoch, s, old_node)
  if old_node ~= '' and old_node ~= me then redis.call('SREM', prefix .. 'pheld:' .. old_node, cid) end
  redis.call('HSET', s, 'holder', epoch, 'hnode', me, 'was', epoch)
  redis.call('SADD', prefix .. 'pheld:' .. me, cid)
  redis.call('ZADD', sessions, '+inf', cid)
  local flat = redis.call('HGETALL', key('pfl', cid))
  local held, bytes = {}, 0
  for i = 1, #flat, 2 do
    held[#held + 1] = {tonumber(flat[i]), cmsgpack.unpack(flat[i + 1])}
    bytes = bytes + #held[#held][2][6]
  end
  -- Recounted from what is in flight: a session kept before 'fb' existed starts right.
  redis.call('HSET', s, 'fb', bytes)
  table.sort(held, function(a, b) return a[2][1] < b[2][1] end)
  local packets = {}
  local v5 = speaks5(cid)
  for _, h in ipairs(held) do
    local m = h[2]
    if m[4] == 2 then packets[#packets + 1] = pubrel(h[1])
    else
      local props = nil
      if v5 then props = counted(m[7] or '', m[8], true) end
      packets[#packets + 1] = publish(m[5], m[6], m[2], m[3], h[1], true, props)
    end
  end
  fill(cid, packets)
  send(cid, epoch, me, packets)
  return #packets
end

-- What an MQTT 5 session's options on the ``filters`` that matched make of a message
-- (as Subscriptions.shaped): nil if No Local skips it (``own``, and every one says so),
-- else the retain flag (Retain As Published) and the Subscription Identifiers to add.
local function shaped(cid, filters, own, retain)
  local nl, rap, ids, seen = true, false, {}, {}
  for _, f in ipairs(filters) do
    local value = tonumber(redis.call('HGET', key('psubo', cid), f) or '0')
    if value % 2 == 0 then nl = false end
    if math.floor(value / 2) % 2 == 1 then rap = true end
    local id = math.floor(value / 4)
    if id > 0 and not seen[id] then
      seen[id] = true
      ids[#ids + 1] = id
    end
  end
  if own and nl then return nil end
  table.sort(ids)
  local extra = ''
  for _, id in ipairs(ids) do extra = extra .. string.char(11) .. varlen(id) end
  if rap and retain == 1 then return 1, extra end
  return 0, extra
end

if op == 'route' then
  -- ARGV[12] topic, [13] payload, [14] qos, [15] the publisher's MQTT 5 properties
  -- (packed), [16] its retain flag, [17] its client id (for No Local), [18] mode: 'f'
  -- filters follow (route to their sessions), 'q' filters follow (only say who they
  -- are, with usernames, for the ACL), 't' a count n, n (session, qos) pairs, then the
  -- filters (route to exactly those sessions).
  local topic, payload, qos, mode = ARGV[12], ARGV[13], tonumber(ARGV[14]), ARGV[18]
  local props, retain, origin = ARGV[15], tonumber(ARGV[16]), ARGV[17]
  local levels, order, matched = {}, {}, {}
  local first = 19
  if mode == 't' then
    local n = tonumber(ARGV[19])
    for i = 20, 19 + 2 * n, 2 do
      order[#order + 1] = ARGV[i]
      levels[ARGV[i]] = tonumber(ARGV[i + 1])
      matched[ARGV[i]] = {}
    end
    first = 20 + 2 * n
  end
  for i = first, #ARGV do
    local flat = redis.call('HGETALL', key('pf', ARGV[i]))
    for j = 1, #flat, 2 do
      local c, level = flat[j], math.min(qos, tonumber(flat[j + 1]))
      if mode ~= 't' then
        local had = levels[c]
        if had == nil then
          order[#order + 1] = c
          levels[c] = level
          matched[c] = {}
        elseif level > had then
          levels[c] = level
        end
      end
      local m = matched[c]
      if m then m[#m + 1] = ARGV[i] end
    end
  end
  if mode == 'q' then
    local out = {}
    for _, c in ipairs(order) do
      if levels[c] > 0 then
        out[#out + 1] = c
        out[#out + 1] = levels[c]
        out[#out + 1] = redis.call('HGET', key('ps', c), 'user') or ''
      end
    end
    return out
  end
  local pushed, dropped, newly = 0, 0, {}
  for _, c in ipairs(order) do
    local flag, extra = 0, ''
    if levels[c] > 0 and speaks5(c) then
      flag, extra = shaped(c, matched[c], c == origin, retain)
    end
    if levels[c] > 0 and flag ~= nil then
      local r = push(c, levels[c], flag, topic, payload, props .. extra)
      if r > 0 then
        pushed = pushed + 1
      elseif r < 0 then
        dropped = dropped + 1
        if r == -1 then newly[#newly + 1] = c end
      end
    end
  end
  return {pushed, dropped, newly}
elseif op == 'lose' then
  -- ARGV[12] the node, [13] '1': only while its lease is gone; client ids from [14].
  local dead = ARGV[12]
  if ARGV[13] == '1' and redis.call('EXISTS', prefix .. 'node:' .. dead) == 1 then return -1 end
  local n = 0
  for i = 14, #ARGV do
    local c = ARGV[i]
    local s = key('ps', c)
    local cur = redis.call('HMGET', s, 'holder', 'hnode')
    if cur[1] and cur[1] ~= '' and cur[2] == dead then
      detach(c, s, dead)
      n = n + 1
    else
      redis.call('SREM', prefix .. 'pheld:' .. dead, c)
    end
  end
  return n
elseif op == 'expire' then
  local ids = redis.call('ZRANGEBYSCORE', sessions, '-inf', now, 'LIMIT', 0, tonumber(ARGV[12]))
  local n = 0
  for _, c in ipairs(ids) do
    local holder = redis.call('HGET', key('ps', c), 'holder')
    if holder and holder ~= '' then
      redis.call('ZADD', sessions, '+inf', c)
    elseif holder then
      n = n + expire(c)
    else
      redis.call('ZREM', sessions, c)
    end
  end
  return {n, #ids}
end

-- Every other operation is about one session: ARGV[12] its client id.
local cid = ARGV[12]
local s = key('ps', cid)
if op == 'open' then
  -- ARGV[13] the username ('' for none, else '=' .. name); ARGV[14] how many sessions
  -- the fleet keeps at most (a new one past it is refused: -1); ARGV[15] '1' if the
  -- client speaks MQTT 5.0; ARGV[16] a new session's expiry in ms ('': the fleet's);
  -- ARGV[17] '0': resume a stored session but make none (-2 if there is none); ARGV[18]
  -- the ms a session taken over is kept at least (persistent.TAKEOVER_GRACE). A
  -- resumed session also returns its subscriptions' options.
  local v5 = ARGV[15] or '0'
  local holder = redis.call('HGET', s, 'holder')
  local expired = 0
  if holder then
    local deadline = redis.call('ZSCORE', sessions, cid)
    if holder == '' and deadline and tonumber(deadline) <= now then
      expire(cid)  -- expired, though not yet swept
      expired = 1
    else
      local grace = tonumber(ARGV[18] or '0')
      if holder ~= '' and expiry_of(s) < grace then
        -- A takeover: the connection it takes over ends after this open, and its detach
        -- must not end the session before this one's attach sets the expiry.
        redis.call('HSET', s, 'exp', grace)
      end
      if holder ~= '' then redis.call('HSET', s, 'reopened', '1') end
      redis.call('HSET', s, 'user', ARGV[13], 'v5', v5)
      local subs, opts = redis.call('HGETALL', key('psub', cid)), redis.call('HGETALL', key('psubo', cid))
      return {1, subs, redis.call('SMEMBERS', key('pin', cid)), 0, opts}
    end
  end
  if ARGV[17] == '0' then return {-2, {}, {}, expired} end
  local most = tonumber(ARGV[14] or '0')
  if most > 0 and redis.call('ZCARD', sessions) >= most then
    redis.call('HINCRBY', stats, 'refused', 1)
    return {-1, {}, {}, expired}
  end
  local exp = tonumber(ARGV[16] or '') or expiry
  -- Counted as left now: a connection that dies before its CONNACK never attaches.
  redis.call('HSET', s, 'holder', '', 'hnode', '', 'was', '', 'left', now, 'user', ARGV[13],
    'lastid', 0, 'seq', 0, 'qb', 0, 'v5', v5, 'exp', exp)
  redis.call('ZADD', sessions, now + exp, cid)
  return {0, {}, {}, expired}
elseif op == 'attach' or op == 'reattach' then
  -- ARGV[13] the epoch; [14] the expiry (ms) the session has from now on ('' or absent:
  -- as it was). A reattach (a node that was declared lost and still holds the
  -- connection) applies only if nobody attached since; -1: there is no such session.
  local cur = redis.call('HMGET', s, 'holder', 'hnode', 'was')
  if not cur[1] then
    if op == 'reattach' then return -1 end
    return 0
  end
  if op == 'reattach' and (cur[1] ~= '' or cur[3] ~= ARGV[13]) then return 0 end
  -- Only the session that holds the client id takes its messages: one whose claim lost
  -- to a newer session's (they crossed) is being evicted, and must not take them away.
  local owner = redis.call('HMGET', key('dev', cid), 'status', 'epoch')
  if owner[1] ~= 'online' or owner[2] ~= ARGV[13] then return 0 end
  if op == 'attach' and ARGV[14] and ARGV[14] ~= '' then redis.call('HSET', s, 'exp', ARGV[14]) end
  redis.call('HDEL', s, 'reopened')
  return attach(cid, ARGV[13], s, cur[2])
elseif op == 'detach' then
  -- ARGV[13] the epoch; [14] the expiry its DISCONNECT set, in ms ('': unchanged; 0: the
  -- session ends now).
  local cur = redis.call('HMGET', s, 'holder', 'hnode')
  if cur[1] ~= ARGV[13] then return 0 end  -- not (or no longer) the holder's report
  -- Not for a session a newer connection resumed meanwhile: its CONNACK's attach decides.
  if ARGV[14] and ARGV[14] ~= '' and not redis.call('HGET', s, 'reopened') then
    redis.call('HSET', s, 'exp', ARGV[14])
  end
  return 1 + detach(cid, s, cur[2])  -- 2: it ended there
elseif op == 'sub' then
  -- ARGV[13] filter, [14] qos, [15] its MQTT 5 options, packed ('0' or absent: none).
  if redis.call('EXISTS', s) == 0 then return 0 end
  redis.call('HSET', key('psub', cid), ARGV[13], ARGV[14])
  if ARGV[15] and ARGV[15] ~= '0' then
    redis.call('HSET', key('psubo', cid), ARGV[13], ARGV[15])
  else
    redis.call('HDEL', key('psubo', cid), ARGV[13])
  end
  index(ARGV[13], cid, ARGV[14])
  return 1
elseif op == 'unsub' then
  if redis.call('HDEL', key('psub', cid), ARGV[13]) == 1 then unindex(ARGV[13], cid) end
  redis.call('HDEL', key('psubo', cid), ARGV[13])
  return 1
elseif op == 'ack' or op == 'acks' then
  -- ARGV[13] epoch; 'ack': [14] puback | pubrec | pubcomp, [15] packet id; 'acks': [14]
  -- a run of them read together, three bytes each (the kind's place in puback, pubrec,
  -- pubcomp, then the packet id), as servers.heartbeat.persistent.AckedTogether packs
  -- them: taken in order, the window refilled as it goes, and sent in one entry.
  local cur = redis.call('HMGET', s, 'holder', 'hnode')
  if cur[1] ~= ARGV[13] then return 0 end  -- from a connection that lost the session
  local fl, packets = key('pfl', cid), {}
  local function ack(kind, pid)
    local raw = redis.call('HGET', fl, pid)
    if not raw then return end
    local m = cmsgpack.unpack(raw)
    if kind == 'puback' then
      if m[2] ~= 1 then return end
      redis.call('HDEL', fl, pid)
      flying(s, -#m[6])
      fill(cid, packets)
    elseif kind == 'pubrec' then
      if m[2] ~= 2 then return end
      m[4] = 2
      redis.call('HSET', fl, pid, cmsgpack.pack(m))
      packets[#packets + 1] = pubrel(tonumber(pid))
    elseif kind == 'pubcomp' then
      if m[4] ~= 2 then return end
      redis.call('HDEL', fl, pid)
      flying(s, -#m[6])
      fill(cid, packets)
    end
  end
  if op == 'ack' then
    ack(ARGV[14], ARGV[15])
  else
    local kinds, run = {'puback', 'pubrec', 'pubcomp'}, ARGV[14]
    for j = 1, #run - 2, 3 do
      local kind = kinds[run:byte(j) + 1]
      if kind then ack(kind, tostring(struct.unpack('>H', run, j + 1))) end
    end
  end
  send(cid, cur[1], cur[2], packets)
  return #packets
elseif op == 'inbound' then
  if redis.call('EXISTS', s) == 0 then return 0 end
  if ARGV[14] == '1' then redis.call('SADD', key('pin', cid), ARGV[13])
  else redis.call('SREM', key('pin', cid), ARGV[13]) end
  return 1
elseif op == 'push' then
  return push(cid, tonumber(ARGV[13]), tonumber(ARGV[14]), ARGV[15], ARGV[16], ARGV[17])
elseif op == 'discard' then
  return discard(cid)
end
return redis.error_reply('unknown session operation ' .. op)
