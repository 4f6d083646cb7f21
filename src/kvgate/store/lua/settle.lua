-- kvgate settle: release one reservation and book its usage, atomically and exactly once.
-- ARGV[1] prefix, ARGV[2] JSON (see RedisStore.settle). Returns JSON {ok, expired, now}.
--
-- The reservation's billing record decides: found, it is consumed (so a second or a late
-- duplicate settlement finds nothing and applies nothing, however late it comes) and the
-- usage is booked. If the lease is still there, backend capacity and the tenant hold are
-- released; if it expired (the sweep already gave them back), only what was used is charged.
-- No record: nothing is applied, unless the caller says `loc` (the usage of a request a
-- replica admitted locally while Redis was down, which never had a record here): then it is
-- booked once, its id remembered in "done" for `keep` seconds against a redelivery.

local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now = clock(a)
local done = P .. ':done'
local rk = P .. ':r|' .. a.b
local limits = {}
for _, lim in ipairs(a.sc) do
  limits[lim.k] = lim
end
local cost_h, cost_l = m_parse(a.cost)
local bill = redis.call('HGET', P .. ':bill', a.id)
local lapses = redis.call('ZSCORE', P .. ':billx', a.id)
if bill and lapses and tonumber(lapses) <= now then
  -- Nobody renewed or settled it for its whole retention: forgotten, not booked.
  bill_drop(P, a.id, rec_decode(bill))
  bill = nil
end
local rec
local expired = false
if bill then
  rec = rec_decode(bill)
  bill_drop(P, a.id, rec)
  local raw = redis.call('HGET', rk, a.id)
  if raw then
    redis.call('HDEL', rk, a.id)
    redis.call('ZREM', P .. ':leases', a.b .. '|' .. a.id)
    release_backend(P, a.b, rec)
    release_hold(P, rec, a.pt + a.ot, cost_h, cost_l, limits, now, false)
  else
    expired = true
    charge_expired(P, rec, a.pt + a.ot, cost_h, cost_l, limits, now)
  end
  if a.completed then
    -- The throughput estimate behind Retry-After (policy/kv.py ThroughputEstimate.observe).
    local duration = now - tonumber(rec.s)
    local bk = P .. ':b|' .. a.b
    if duration > 0 and redis.call('EXISTS', bk) == 1 then
      local v = redis.call('HMGET', bk, 'spot', 'otpr', 'samples')
      local spot, otpr, samples = tonumber(v[1]) or 0.02, tonumber(v[2]) or 256.0, tonumber(v[3]) or 0
      local per = duration / math.max(1, a.ot)
      if samples == 0 then
        spot, otpr = per, a.ot
      else
        spot = spot + 0.2 * (per - spot)
        otpr = otpr + 0.2 * (a.ot - otpr)
      end
      redis.call('HSET', bk, 'spot', num(spot), 'otpr', num(otpr), 'samples', samples + 1)
    end
  end
elseif a.loc and not redis.call('ZSCORE', done, a.id) then
  rec = { t = a.t, m = a.m, dk = a.dk, mk = a.mk }
  local h = tenant_key(P, a.t)
  hmoney_add(h, 'sp|' .. a.dk, cost_h, cost_l)
  hmoney_add(h, 'sp|' .. a.mk, cost_h, cost_l)
  for _, s in ipairs(a.lv or {}) do
    level_money_add(P, a.t, s, a.dk, 'sp', cost_h, cost_l, false)
    level_money_add(P, a.t, s, a.mk, 'sp', cost_h, cost_l, false)
  end
  -- Remembered for `keep` seconds: a redelivery (its first attempt timed out after landing)
  -- within that window applies nothing.
  redis.call('ZADD', done, num(now), a.id)
  redis.call('ZREMRANGEBYSCORE', done, '-inf', num(now - a.keep))
else
  return cjson.encode({ ok = false, expired = false, now = num(now) })
end

-- The ledger: all-time per (tenant, model), and per (tenant, period, model) for the day and
-- the month of admission. Token counts are HINCRBY (exact int64); money is a decimal string.
local function book(key, f)
  redis.call('HINCRBY', key, f .. 'req', 1)
  redis.call('HINCRBY', key, f .. 'pt', a.pt)
  redis.call('HINCRBY', key, f .. 'ot', a.ot)
  redis.call('HINCRBY', key, f .. 'ct', a.ct)
  hmoney_add(key, f .. 'cost', cost_h, cost_l)
end
book(P .. ':tot', rec.t .. '|' .. rec.m .. '|')
book(P .. ':l|' .. rec.t .. '|' .. rec.dk, rec.m .. '|')
book(P .. ':l|' .. rec.t .. '|' .. rec.mk, rec.m .. '|')
-- Per ledger a request held (a backend, or a pool's endpoint): what the engines were sent,
-- reconciled with their own token counters.
book(P .. ':btot', a.b .. '|')
return cjson.encode({ ok = true, expired = expired, now = num(now) })
