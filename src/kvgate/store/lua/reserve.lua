-- kvgate reserve: the whole admission check-and-reserve of one request, atomically.
-- ARGV[1] prefix, ARGV[2] JSON (see RedisStore.reserve), ARGV[3] the tenant's rules (JSON). Returns JSON: the state every limit
-- was checked against (so the caller can explain the decision with the policy's own code)
-- and whether the request was admitted, in which case everything has been reserved.

local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now, wall = clock(a)
local expired = sweep(P, now, 100)
-- An abandoned request (its caller gave up on this very call, or on an earlier attempt)
-- commits nothing: this reserve landed after its compensating release.
-- (A request without an id cannot be abandoned, so it is not indexed either.)
local rq = a.t .. '|' .. a.rid
local gone = a.rid ~= '' and redis.call('ZSCORE', P .. ':ab', rq)
if gone and tonumber(gone) > now then
  return cjson.encode({ ab = true, ok = false, now = num(now), wall = num(wall), exp = expired })
end
local dk, mk = period_keys(wall)
local th = tenant_key(P, a.t)
-- The tenant's rules (every scope), kept verbatim (exact floats) for sweeps of its leases.
redis.call('HSET', th, 'pol', ARGV[3])
local out = { now = num(now), wall = num(wall), dk = dk, mk = mk, exp = expired }

-- Tenant limits: every scope (tenant-wide, then tenant x model), then the budgets. The
-- snapshot in `out` is taken before any refill: the caller's policy code refills exactly as
-- the memory store does, and so does this script (a refill at `now` happens when the
-- policy's would), so both keep bit-identical levels. With `a.pre` the pre-check took the
-- RPM request: it is not taken again (and only a debt counts as over RPM).
local enforced, conc_hit, scopes, money = tenant_check(P, th, a, now, dk, mk, out)

-- The backend: KV in flight (whole blocks) and concurrency.
local bk = P .. ':b|' .. a.b
local rk = P .. ':r|' .. a.b
redis.call('SADD', P .. ':be', a.b)
redis.call('HSET', bk, 'kvb', a.kvb, 'mc', a.mc)
local bv = redis.call('HMGET', bk, 'kv', 'n', 'spot', 'otpr')
local kvin, n = tonumber(bv[1]) or 0, tonumber(bv[2]) or 0
out.kvin, out.n = kvin, n

local backend_ok = true
if a.kv > a.kvb then
  backend_ok = false
elseif n >= a.mc then
  backend_ok = false
  out.w_slot = until_freed(rk, bv, now, 0, 1, nil)
elseif a.kv > a.kvb - kvin then
  backend_ok = false
  out.w_kv = until_freed(rk, bv, now, a.kv - (a.kvb - kvin), 0, nil)
end
if conc_hit then
  out.w_tenant = until_freed(rk, bv, now, 0, 1, a.t)
end

local admitted = backend_ok and not enforced
if admitted then
  for _, sc in ipairs(scopes) do
    if sc.r and not a.pre then
      take(sc.r, 1, now)
    end
    if sc.t then
      take(sc.t, a.tk, now)
    end
    sc.n = sc.n + 1
  end
  local rs_dh, rs_dl = m_add(money.rs_dh, money.rs_dl, money.cost_h, money.cost_l)
  local rs_mh, rs_ml = m_add(money.rs_mh, money.rs_ml, money.cost_h, money.cost_l)
  redis.call('HSET', th, 'rs|' .. dk, m_str(rs_dh, rs_dl), 'rs|' .. mk, m_str(rs_mh, rs_ml))
  -- Every level of the caller holds the cost too (its ledger, budget or not).
  for _, s in ipairs(a.lv or {}) do
    level_money_add(P, a.t, s, dk, 'rs', money.cost_h, money.cost_l, false)
    level_money_add(P, a.t, s, mk, 'rs', money.cost_h, money.cost_l, false)
  end
  redis.call('HINCRBY', bk, 'kv', a.kv)
  redis.call('HINCRBY', bk, 'n', 1)
  local keys = {}
  for i, lim in ipairs(a.sc) do
    keys[i] = lim.k
  end
  local rec = rec_encode({
    rid = a.rid, t = a.t, m = a.m, p = a.p, x = a.x, c = a.c, cost = a.cost, kv = a.kv,
    s = num(now), tk = a.tk, sc = keys, dk = dk, mk = mk, b = a.b,
    -- the caller's level scopes, whose money this request holds
    lv = (a.lv and #a.lv > 0) and a.lv or nil,
    -- the pre-check took the RPM request: an abandon does not give it back
    pre = a.pre or nil,
  })
  redis.call('HSET', rk, a.id, rec)
  redis.call('ZADD', P .. ':leases', num(now + a.ttl), a.b .. '|' .. a.id)
  -- The billing record: outlives the lease, consumed by the first settlement.
  redis.call('HSET', P .. ':bill', a.id, rec)
  redis.call('ZADD', P .. ':billx', num(now + a.keep), a.id)
  if a.rid ~= '' then
    redis.call('HSET', P .. ':rq', rq, a.b .. '|' .. a.id)
  end
end
scopes_save(th, scopes, now, false)
out.ok = admitted
return cjson.encode(out)
