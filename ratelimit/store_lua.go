package ratelimit

import "github.com/redis/go-redis/v9"

// The scripts. Each limit set i has eight arguments: requests per second,
// burst, tokens per minute, max concurrent, requests per day, tokens per
// day, micro-dollars per day and per UTC month (0: none). The admission
// script's come after the token estimate, the lease, its time, the
// micro-dollar estimate, and the count and names of the tenant's leases
// whose release is on its way (taken out of the concurrency sets first:
// their release is idempotent), each set after the tokens those releases
// give back to it (counted by the check, written by the releases); the
// release script's after its first five (the lease, the tokens reserved
// and used, the micro-dollars reserved and used). The month is the UTC
// calendar month, from the store's clock (months, monthOf in Go); charge
// and reconcile write the day's and month's counters.
const luaShared = `
-- charge adds n to counter k, kept ttl seconds.
local function charge(k, n, ttl)
  redis.call('INCRBY', k, n)
  redis.call('EXPIRE', k, ttl)
end
-- reconcile moves counter k by delta (a use against its reservation),
-- never below 0, kept ttl seconds.
local function reconcile(k, delta, ttl)
  if redis.call('INCRBY', k, delta) < 0 then redis.call('SET', k, 0) end
  redis.call('EXPIRE', k, ttl)
end

local function months(now)
  local z = math.floor(now / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  if m <= 2 then y = y + 1 end
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  local yy = ny
  if nm <= 2 then yy = yy - 1 end
  local e2 = math.floor(yy / 400)
  local yoe2 = yy - e2 * 400
  local mp2 = nm > 2 and nm - 3 or nm + 9
  local doy2 = math.floor((153 * mp2 + 2) / 5)
  local doe2 = yoe2 * 365 + math.floor(yoe2 / 4) - math.floor(yoe2 / 100) + doy2
  local nextStart = (e2 * 146097 + doe2 - 719468) * 86400
  return y * 12 + (m - 1), nextStart - now
end
`

var admitScript = redis.NewScript(luaShared + `
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local day = math.floor(tonumber(t[1]) / 86400)
local untilDay = (day + 1) * 86400 - now
local mon, untilMon = months(tonumber(t[1]))
untilMon = untilMon - tonumber(t[2]) / 1e6
local est, lease, ttl, estUSD, nrel = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local base = 5 + 3 * nrel
-- A release on its way whose script ran already gives nothing more back.
local landed = {}
for j = 1, nrel do
  landed[j] = redis.call('EXISTS', KEYS[1] .. ':rel:' .. ARGV[3 * j + 3]) == 1
end
local wait, reason = 0, ''
local st = {}
for i = 1, #KEYS do
  local o = base + (i - 1) * 9 + 1
  local credit = tonumber(ARGV[o])
  for j = 1, nrel do
    if not landed[j] then credit = credit + tonumber(ARGV[3 * j + 3 + i]) end
  end
  local rps, burst, tpm, maxc, rpd, tpd = tonumber(ARGV[o+1]), tonumber(ARGV[o+2]), tonumber(ARGV[o+3]), tonumber(ARGV[o+4]), tonumber(ARGV[o+5]), tonumber(ARGV[o+6])
  local usdd, usdm = tonumber(ARGV[o+7]), tonumber(ARGV[o+8])
  local b = KEYS[i]
  local s = {}
  if maxc > 0 then
    redis.call('ZREMRANGEBYSCORE', b .. ':conc', '-inf', now)
    for j = 1, nrel do redis.call('ZREM', b .. ':conc', ARGV[3 * j + 3]) end
    if redis.call('ZCARD', b .. ':conc') >= maxc then
      return {0, '-1', 'concurrency'}
    end
  end
  if rps > 0 then
    local v = redis.call('HMGET', b .. ':rps', 'l', 't')
    local l, ts = tonumber(v[1]) or burst, tonumber(v[2]) or now
    l = math.min(burst, l + math.max(0, now - ts) * rps)
    s.rps = l
    if l < 1 and (1 - l) / rps > wait then wait, reason = (1 - l) / rps, 'requests' end
  end
  if tpm > 0 then
    local v = redis.call('HMGET', b .. ':tpm', 'l', 't')
    local l, ts = tonumber(v[1]) or tpm, tonumber(v[2]) or now
    l = math.min(tpm, l + math.max(0, now - ts) * tpm / 60)
    s.tpm = l
    local need, have = math.min(est, tpm), math.min(tpm, l + credit)
    if have < need and (need - have) / (tpm / 60) > wait then wait, reason = (need - have) / (tpm / 60), 'tokens' end
  end
  if rpd > 0 and tonumber(redis.call('GET', b .. ':rpd:' .. day) or '0') >= rpd and untilDay > wait then
    wait, reason = untilDay, 'requests_per_day'
  end
  if tpd > 0 and tonumber(redis.call('GET', b .. ':tpd:' .. day) or '0') - credit + math.min(est, tpd) > tpd and untilDay > wait then
    wait, reason = untilDay, 'tokens_per_day'
  end
  if usdd > 0 and tonumber(redis.call('GET', b .. ':usdd:' .. day) or '0') + math.min(estUSD, usdd) > usdd and untilDay > wait then
    wait, reason = untilDay, 'usd_per_day'
  end
  if usdm > 0 and tonumber(redis.call('GET', b .. ':usdm:' .. mon) or '0') + math.min(estUSD, usdm) > usdm and untilMon > wait then
    wait, reason = untilMon, 'usd_per_month'
  end
  st[i] = s
end
if wait > 0 then
  return {0, tostring(wait), reason}
end
for i = 1, #KEYS do
  local o = base + (i - 1) * 9 + 1
  local rps, burst, tpm, maxc, rpd, tpd = tonumber(ARGV[o+1]), tonumber(ARGV[o+2]), tonumber(ARGV[o+3]), tonumber(ARGV[o+4]), tonumber(ARGV[o+5]), tonumber(ARGV[o+6])
  local usdd, usdm = tonumber(ARGV[o+7]), tonumber(ARGV[o+8])
  local b, s = KEYS[i], st[i]
  if maxc > 0 then
    redis.call('ZADD', b .. ':conc', now + ttl, lease)
    redis.call('EXPIRE', b .. ':conc', math.ceil(ttl) + 60)
  end
  if rps > 0 then
    local l = s.rps - 1
    redis.call('HSET', b .. ':rps', 'l', l, 't', now)
    redis.call('EXPIRE', b .. ':rps', math.ceil((burst - l) / rps) + 60)
  end
  if tpm > 0 then
    local l = s.tpm - est
    redis.call('HSET', b .. ':tpm', 'l', l, 't', now)
    redis.call('EXPIRE', b .. ':tpm', math.ceil((tpm - l) / (tpm / 60)) + 60)
  end
  if rpd > 0 then charge(b .. ':rpd:' .. day, 1, 2 * 86400) end
  if tpd > 0 then charge(b .. ':tpd:' .. day, est, 2 * 86400) end
  if usdd > 0 then charge(b .. ':usdd:' .. day, estUSD, 2 * 86400) end
  if usdm > 0 then charge(b .. ':usdm:' .. mon, estUSD, 32 * 86400) end
end
return {1}
`)

var releaseScript = redis.NewScript(luaShared + `
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local day = math.floor(tonumber(t[1]) / 86400)
local mon = months(tonumber(t[1]))
local lease, reserved, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local resUSD, actUSD = tonumber(ARGV[4]), tonumber(ARGV[5])
local gives = reserved ~= actual or resUSD ~= actUSD
-- Sent again (a retry after a failed call that may have landed): once.
if gives and redis.call('EXISTS', KEYS[1] .. ':rel:' .. lease) == 1 then return 1 end
for i = 1, #KEYS do
  local o = 5 + (i - 1) * 8
  local tpm, maxc, tpd = tonumber(ARGV[o+3]), tonumber(ARGV[o+4]), tonumber(ARGV[o+6])
  local usdd, usdm = tonumber(ARGV[o+7]), tonumber(ARGV[o+8])
  local b = KEYS[i]
  if maxc > 0 then redis.call('ZREM', b .. ':conc', lease) end
  if tpm > 0 and reserved ~= actual then
    local v = redis.call('HMGET', b .. ':tpm', 'l', 't')
    local l, ts = tonumber(v[1]) or tpm, tonumber(v[2]) or now
    l = math.min(tpm, l + math.max(0, now - ts) * tpm / 60 + reserved - actual)
    redis.call('HSET', b .. ':tpm', 'l', l, 't', now)
    redis.call('EXPIRE', b .. ':tpm', math.ceil((tpm - l) / (tpm / 60)) + 60)
  end
  if tpd > 0 and reserved ~= actual then reconcile(b .. ':tpd:' .. day, actual - reserved, 2 * 86400) end
  if usdd > 0 and resUSD ~= actUSD then reconcile(b .. ':usdd:' .. day, actUSD - resUSD, 2 * 86400) end
  if usdm > 0 and resUSD ~= actUSD then reconcile(b .. ':usdm:' .. mon, actUSD - resUSD, 32 * 86400) end
end
-- Landed: a decision that still sees this release on its way leaves its
-- tokens out (the replica confirms it a round trip later).
if gives then redis.call('SET', KEYS[1] .. ':rel:' .. lease, '1', 'EX', 300) end
return 1
`)

// renewScript: ARGV[1] the lease time, then for each key the lease it
// holds in it. A lease the set lost is added back: only leases of requests
// still in flight are renewed, and their releases are sent after.
var renewScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], now + ttl, ARGV[i + 1])
  redis.call('EXPIRE', KEYS[i], math.ceil(ttl) + 60)
end
return 1
`)

var heartbeatScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])) + 60)
return redis.call('ZCARD', KEYS[1])
`)
