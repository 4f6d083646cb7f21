-- kvgate settle: release one reservation and book its usage, atomically and exactly once.
-- ARGV[1] prefix, ARGV[2] JSON (see RedisStore.settle). Returns JSON {ok, now}.
--
-- A reservation found: free backend capacity and the tenant hold, book the ledger.
-- Not found, it was settled before or its lease expired: nothing is applied, unless the
-- caller says `late` (a settlement that could not reach Redis earlier, or a request admitted
-- by a replica's local fallback): then its usage is booked once, marked by id in "done".

local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now = clock(a)
local done = P .. ':done'
local rk = P .. ':r|' .. a.b
local raw = redis.call('HGET', rk, a.id)
local rec
if raw then
  rec = rec_decode(raw)
  redis.call('HDEL', rk, a.id)
  redis.call('ZREM', P .. ':leases', a.b .. '|' .. a.id)
  release_backend(P, a.b, rec)
  local limits = {}
  for _, lim in ipairs(a.sc) do
    limits[lim.k] = lim
  end
  local cost_h, cost_l = m_parse(a.cost)
  release_hold(P, rec, a.pt + a.ot, cost_h, cost_l, limits, now)
  if a.completed then
    -- The throughput estimate behind Retry-After (policy/kv.py ThroughputEstimate.observe).
    local duration = now - tonumber(rec.s)
    if duration > 0 then
      local bk = P .. ':b|' .. a.b
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
elseif a.late and not redis.call('ZSCORE', done, a.id) then
  rec = { t = a.t, m = a.m, dk = a.dk, mk = a.mk }
  local cost_h, cost_l = m_parse(a.cost)
  local h = tenant_key(P, a.t)
  hmoney_add(h, 'sp|' .. a.dk, cost_h, cost_l)
  hmoney_add(h, 'sp|' .. a.mk, cost_h, cost_l)
else
  return cjson.encode({ ok = false, now = num(now) })
end

-- The ledger: all-time per (tenant, model), and per (tenant, period, model) for the day and
-- the month of admission. Token counts are HINCRBY (exact int64); money is a decimal string.
local cost_h, cost_l = m_parse(a.cost)
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

-- Settled ids are remembered for `keep` seconds: a late copy of this settlement (its first
-- attempt timed out after landing) arriving within that window applies nothing.
redis.call('ZADD', done, num(now), a.id)
redis.call('ZREMRANGEBYSCORE', done, '-inf', num(now - a.keep))
return cjson.encode({ ok = true, now = num(now) })
