"""The Redis store's Lua scripts. Each runs atomically in Redis, so a decision and its bookkeeping cannot interleave
with another process's: that is what makes limits shared by several processes exact.

Per scope, six keys (in this order, see RedisLimitStore._scope_keys):
    win    sorted set  reservation id -> admission time        (the rolling window's log)
    wtok   hash        reservation id -> tokens                 (estimate, then real usage once settled)
    wsum   string      the sum of wtok over the window
    slots  sorted set  reservation id -> lease expiry time      (concurrency slots as leases)
    day    hash        {requests, tokens, spend} of one UTC day (spend in micro-dollars), and {held_tokens,
                       held_spend}: what open reservations counted there hold as their most
    month  hash        {spend, held_spend} of one UTC calendar month
Times come from the caller (ARGV), so every process must have a synchronised clock (NTP), and tests can inject one.

Each reservation also has a record: "1" while it is booked (deleted when it is settled), or "0" for a reservation
finished before Redis ran it (a release that overtook its unanswered reservation: see SETTLE), so that it is never
booked when it does run.
"""

# Shared by both scripts: Lua's unpack() has a stack limit, so long lists go in batches.
_COMMON = """
local function in_batches(list, fn)
  for i = 1, #list, 500 do fn({unpack(list, i, math.min(i + 499, #list))}) end
end
"""

# KEYS: the reservation record, then six keys per scope.
# ARGV: now, tokens, id, lease, window, day_ttl, record_ttl, concurrency_retry, cost, to_month_end, month_ttl, then
# per scope the seven limits in Dimension order (requests/min, tokens/min, concurrent, daily tokens, daily requests,
# daily spend, monthly spend), 0 meaning none.
# Returns {admitted, then per limited dimension: scope index, dimension index, limit, used, wait (a string), held
# (of used, what requests in flight hold: core.Reading.held)}, or
# {-1} for a reservation decided before: run again (resent after a broken connection), or already released.
RESERVE = _COMMON + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {-1} end
-- Redis refuses a script's write for want of memory (maxmemory under noeviction: OOM) only until the script has
-- written anything, and pruning below writes with commands it lets through when full: without this first write (a
-- no-op, SETRANGE of nothing on the record, absent here, which Redis refuses when full) a full Redis booked every
-- request past its maxmemory instead of refusing it, as it refuses the readiness check.
redis.call('SETRANGE', KEYS[1], 0, '')
local now, tokens, id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local lease, window = tonumber(ARGV[4]), tonumber(ARGV[5])
local day_ttl, record_ttl, concurrency_retry = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local cost, to_month_end, month_ttl = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local scopes = (#KEYS - 1) / 6
local to_midnight = (math.floor(now / 86400) + 1) * 86400 - now

local function prune(win, wtok, wsum, slots)
  local gone = redis.call('ZRANGEBYSCORE', win, '-inf', now - window)
  if #gone > 0 then
    local freed = 0
    in_batches(gone, function(part)
      for _, t in ipairs(redis.call('HMGET', wtok, unpack(part))) do freed = freed + (tonumber(t) or 0) end
      redis.call('HDEL', wtok, unpack(part))
    end)
    redis.call('ZREMRANGEBYSCORE', win, '-inf', now - window)
    redis.call('DECRBY', wsum, freed)
  end
  redis.call('ZREMRANGEBYSCORE', slots, '-inf', now)  -- leases that ran out: their holder is gone
end

-- Seconds until entries worth `excess` have left the window; with no excess, until the count next goes down: the
-- oldest entry that counts leaves (one without tokens frees no tokens), else the request's own, not booked yet.
local function window_wait(win, wtok, excess, by_tokens)
  if excess <= 0 and not by_tokens then
    local first = redis.call('ZRANGE', win, 0, 0, 'WITHSCORES')
    if #first == 0 then return window end
    return tonumber(first[2]) + window - now
  end
  excess = math.max(excess, 1)
  if not by_tokens then
    local entry = redis.call('ZRANGE', win, excess - 1, excess - 1, 'WITHSCORES')
    return tonumber(entry[2]) + window - now
  end
  local freed, start = 0, 0
  while true do
    local part = redis.call('ZRANGE', win, start, start + 499, 'WITHSCORES')
    if #part == 0 then return window end
    local ids = {}
    for i = 1, #part, 2 do ids[#ids + 1] = part[i] end
    local counts = redis.call('HMGET', wtok, unpack(ids))
    for i = 1, #ids do
      freed = freed + (tonumber(counts[i]) or 0)
      if freed >= excess then return tonumber(part[2 * i]) + window - now end
    end
    start = start + 500
  end
end

local out, over = {0}, false
-- `counts_tokens`: a token limit, which a request that adds no tokens is not refused by (core.verdict).
local function reading(scope, dimension, limit, used, wait, counts_tokens, held)
  for _, v in ipairs({scope, dimension, limit, used, wait, held or 0}) do out[#out + 1] = v end
  if used > limit and not (counts_tokens and tokens == 0) then over = true end
end

for i = 0, scopes - 1 do
  local k = 1 + i * 6
  local win, wtok, wsum, slots, day = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5]
  local month = KEYS[k + 6]
  prune(win, wtok, wsum, slots)
  -- Of a refusing reading's `used`, what requests in flight hold (only a refusal reads it: core.Reading.held);
  -- none when no slot is leased (a dead process's reservations keep their estimates).
  local function held(used, limit, hash, field)
    if used <= limit or redis.call('ZCARD', slots) == 0 then return 0 end
    return tonumber(redis.call('HGET', hash, field)) or 0
  end
  -- The window's: what the entries of requests in flight (a slot each, pruned above) hold there, their most.
  local function window_held(used, limit)
    if used <= limit then return 0 end
    local sum = 0
    in_batches(redis.call('ZRANGE', slots, 0, -1), function(part)
      for _, t in ipairs(redis.call('HMGET', wtok, unpack(part))) do sum = sum + (tonumber(t) or 0) end
    end)
    return sum
  end
  local a = 12 + i * 7
  local rpm, tpm, concurrent = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local daily_tokens, daily_requests = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local daily_spend, monthly_spend = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  if rpm > 0 then
    local used = redis.call('ZCARD', win) + 1
    reading(i, 0, rpm, used, tostring(window_wait(win, wtok, used - rpm, false)))
  end
  if tpm > 0 then
    local used = (tonumber(redis.call('GET', wsum)) or 0) + tokens
    local wait = 'inf'
    if used == 0 then wait = '0'  -- no tokens counted: none to go down
    elseif tokens <= tpm then wait = tostring(window_wait(win, wtok, used - tpm, true)) end
    reading(i, 1, tpm, used, wait, true, window_held(used, tpm))
  end
  if concurrent > 0 then
    reading(i, 2, concurrent, redis.call('ZCARD', slots) + 1, tostring(concurrency_retry))
  end
  if daily_tokens > 0 then
    local used = (tonumber(redis.call('HGET', day, 'tokens')) or 0) + tokens
    local wait = 'inf'
    if tokens <= daily_tokens then wait = tostring(to_midnight) end
    reading(i, 3, daily_tokens, used, wait, true, held(used, daily_tokens, day, 'held_tokens'))
  end
  if daily_requests > 0 then
    reading(i, 4, daily_requests, (tonumber(redis.call('HGET', day, 'requests')) or 0) + 1, tostring(to_midnight))
  end
  if daily_spend > 0 then
    local wait = 'inf'
    if cost <= daily_spend then wait = tostring(to_midnight) end
    local used = (tonumber(redis.call('HGET', day, 'spend')) or 0) + cost
    reading(i, 5, daily_spend, used, wait, false, held(used, daily_spend, day, 'held_spend'))
  end
  if monthly_spend > 0 then
    local wait = 'inf'
    if cost <= monthly_spend then wait = tostring(to_month_end) end
    local used = (tonumber(redis.call('HGET', month, 'spend')) or 0) + cost
    reading(i, 6, monthly_spend, used, wait, false, held(used, monthly_spend, month, 'held_spend'))
  end
end

if over then return out end
local window_ttl = math.ceil(window + lease)
for i = 0, scopes - 1 do
  local k = 1 + i * 6
  local win, wtok, wsum, slots, day = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5]
  local month = KEYS[k + 6]
  redis.call('ZADD', win, now, id)
  redis.call('HSET', wtok, id, tokens)
  redis.call('INCRBY', wsum, tokens)
  redis.call('ZADD', slots, now + lease, id)
  redis.call('HINCRBY', day, 'requests', 1)
  redis.call('HINCRBY', day, 'tokens', tokens)
  redis.call('HINCRBY', day, 'spend', cost)
  redis.call('HINCRBY', month, 'spend', cost)
  redis.call('HINCRBY', day, 'held_tokens', tokens)
  redis.call('HINCRBY', day, 'held_spend', cost)
  redis.call('HINCRBY', month, 'held_spend', cost)
  redis.call('EXPIRE', month, month_ttl)
  -- Idle scopes disappear; the three window keys always expire together, so they stay consistent.
  for _, key in ipairs({win, wtok, wsum}) do redis.call('EXPIRE', key, window_ttl) end
  redis.call('EXPIRE', slots, math.ceil(lease * 2))
  redis.call('EXPIRE', day, day_ttl)
end
redis.call('SET', KEYS[1], '1', 'EX', record_ttl)
out[1] = 1
return out
"""

# KEYS: the reservation record, then six keys per scope (the day and month keys of the reservation's day).
# ARGV: id, used tokens, estimated tokens, refund (1 or 0), window ttl, used cost, estimated cost, record ttl.
# Returns {1, then per scope its day's and month's spend after it (-1: that day's or month's counters are gone)}, or 0
# if already settled (or never booked).
SETTLE = """
local record = redis.call('GET', KEYS[1])
if record ~= '1' then
  -- Not booked (yet): a reservation whose answer never came may reach Redis after its release, on another
  -- connection. The mark keeps it from being booked then. Or booked in a Redis that lost its data: a slot RENEW
  -- put back since is freed now, not a lease later.
  if not record then redis.call('SET', KEYS[1], '0', 'EX', ARGV[8]) end
  for i = 0, (#KEYS - 1) / 6 - 1 do redis.call('ZREM', KEYS[1 + i * 6 + 4], ARGV[1]) end
  return 0
end
redis.call('DEL', KEYS[1])
local id, used, estimate, refund = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local window_ttl = tonumber(ARGV[5])
local cost_change = tonumber(ARGV[6]) - tonumber(ARGV[7])
if refund then cost_change = 0 - tonumber(ARGV[7]) end
local out = {1}
for i = 0, (#KEYS - 1) / 6 - 1 do
  local k = 1 + i * 6
  local win, wtok, wsum, slots, day = KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5]
  local month = KEYS[k + 6]
  redis.call('ZREM', slots, id)
  local held = tonumber(redis.call('HGET', wtok, id))  -- nil once the entry left the window
  if held then
    if refund then
      redis.call('ZREM', win, id)
      redis.call('HDEL', wtok, id)
      redis.call('DECRBY', wsum, held)
    else
      redis.call('HSET', wtok, id, used)
      redis.call('INCRBY', wsum, used - held)
    end
    for _, key in ipairs({win, wtok, wsum}) do redis.call('EXPIRE', key, window_ttl) end
  end
  local day_spend, month_spend = -1, -1
  if redis.call('EXISTS', day) == 1 then  -- corrections go to the day the request was counted in
    if refund then
      redis.call('HINCRBY', day, 'tokens', 0 - estimate)  -- not -estimate: Lua's -0 reaches Redis as "-0"
      redis.call('HINCRBY', day, 'requests', -1)
    else
      redis.call('HINCRBY', day, 'tokens', used - estimate)
    end
    day_spend = redis.call('HINCRBY', day, 'spend', cost_change)
    redis.call('HINCRBY', day, 'held_tokens', 0 - estimate)
    redis.call('HINCRBY', day, 'held_spend', 0 - tonumber(ARGV[7]))
  end
  if redis.call('EXISTS', month) == 1 then
    month_spend = redis.call('HINCRBY', month, 'spend', cost_change)
    redis.call('HINCRBY', month, 'held_spend', 0 - tonumber(ARGV[7]))
  end
  out[#out + 1] = day_spend
  out[#out + 1] = month_spend
end
return out
"""

# KEYS: per reservation, its record, then its scopes' slots sets. ARGV: lease expiry, the sets' ttl, then per
# reservation: its id and how many scopes it has. The slot of a reservation still booked (its record "1": not settled)
# is pushed to the new expiry, and put back if admission pruned it meanwhile: a Redis that stalled longer than a lease
# let it run out, but its holder is alive (it is renewing), so its request still runs. So is the slot of one without a
# record, which only a Redis that lost its data (restarted empty, a failover) can have: its holder still runs it. One
# marked "0" (finished before Redis ran it) is never re-added. A settled one is not renewed (its holder stops first);
# only a renewal resent after a broken connection could reach Redis after its SETTLE: a slot kept for one lease.
RENEW = """
local expiry, ttl, k, expiring = tonumber(ARGV[1]), tonumber(ARGV[2]), 1, {}
for a = 3, #ARGV, 2 do
  local id, scopes = ARGV[a], tonumber(ARGV[a + 1])
  local booked = redis.call('GET', KEYS[k]) ~= '0'
  for j = 1, scopes do
    if booked then
      redis.call('ZADD', KEYS[k + j], expiry, id)
      expiring[KEYS[k + j]] = true
    end
  end
  k = k + scopes + 1
end
for slots in pairs(expiring) do redis.call('EXPIRE', slots, ttl) end
return 1
"""

# The readiness check (and start-up's): a script that writes, as admissions are, so that Redis refuses it whenever it
# would refuse them (read-only, out of memory, an ACL user allowed writes but not scripts, or scripts but not writes).
# KEYS: the ping key. Returns 1.
PING = """
redis.call('SET', KEYS[1], '1', 'PX', 60000)
return 1
"""
