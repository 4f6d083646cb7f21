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

-- Tenant limits: every scope (tenant-wide, then tenant x model), then the budgets.
local enforced = false
local conc_hit = false
local scopes = {}
local snap = {}
for i, lim in ipairs(a.sc) do
  local sc = scope_load(th, lim.k)
  scope_sync(sc, lim, now)
  -- The snapshot is taken before any refill: the caller's policy code refills exactly as
  -- the memory store does, and so does this script (a refill at `now` happens when the
  -- policy's would), so both keep bit-identical levels.
  local s = { n = sc.n }
  if sc.r then
    s.r = { num(sc.r.level), num(sc.r.at) }
    if wait_for(sc.r, 1, now) > 0 and not lim.r[3] then
      enforced = true
    end
  end
  if sc.t then
    s.t = { num(sc.t.level), num(sc.t.at) }
    local over = a.tk > sc.t.cap
    if (over or wait_for(sc.t, a.tk, now) > 0) and not lim.t[3] then
      enforced = true
    end
  end
  if lim.c and sc.n >= lim.c[1] and not lim.c[2] then
    enforced = true
    conc_hit = true
  end
  scopes[i] = sc
  snap[i] = s
end
out.sc = snap

local sp_dh, sp_dl = m_parse(redis.call('HGET', th, 'sp|' .. dk))
local rs_dh, rs_dl = m_parse(redis.call('HGET', th, 'rs|' .. dk))
local sp_mh, sp_ml = m_parse(redis.call('HGET', th, 'sp|' .. mk))
local rs_mh, rs_ml = m_parse(redis.call('HGET', th, 'rs|' .. mk))
out.sp = { m_str(sp_dh, sp_dl), m_str(sp_mh, sp_ml) }
out.rs = { m_str(rs_dh, rs_dl), m_str(rs_mh, rs_ml) }
local cost_h, cost_l = m_parse(a.cost)
for _, rule in ipairs(a.bu) do
  if not rule[3] then
    local cap_h, cap_l = m_parse(rule[2])
    local lh, ll
    if rule[1] == 'day' then
      lh, ll = m_sub(cap_h, cap_l, sp_dh, sp_dl)
      lh, ll = m_sub(lh, ll, rs_dh, rs_dl)
    else
      lh, ll = m_sub(cap_h, cap_l, sp_mh, sp_ml)
      lh, ll = m_sub(lh, ll, rs_mh, rs_ml)
    end
    if m_gt(cost_h, cost_l, lh, ll) then
      enforced = true
    end
  end
end

-- The backend: KV in flight (whole blocks) and concurrency.
local bk = P .. ':b|' .. a.b
local rk = P .. ':r|' .. a.b
redis.call('SADD', P .. ':be', a.b)
redis.call('HSET', bk, 'kvb', a.kvb, 'mc', a.mc)
local bv = redis.call('HMGET', bk, 'kv', 'n', 'spot', 'otpr')
local kvin, n = tonumber(bv[1]) or 0, tonumber(bv[2]) or 0
out.kvin, out.n = kvin, n

-- When enough in-flight work finishes to free what is missing (policy/kv.py
-- seconds_until_freed): in-flight requests in expected finishing order, from the learnt
-- decode speed. Only computed for a rejection, so the walk costs nothing on admission.
-- Leases finishing at the same moment are taken together: the answer is that moment either
-- way, and plain numbers sort much faster than pairs.
local function until_freed(kv_needed, slots_needed, tenant)
  local spot, otpr = tonumber(bv[3]) or 0.02, tonumber(bv[4]) or 256.0
  local expected_tokens = math.max(1.0, otpr)
  local kv_at, n_at, times = {}, {}, {}
  for _, raw in ipairs(redis.call('HVALS', rk)) do
    local s, kv, x, t = string.match(raw, '^(%S+) (%d+) (%d+) ([^\n]*)')
    if not tenant or t == tenant then
      local at = tonumber(s) + math.min(tonumber(x), expected_tokens) * spot
      if kv_at[at] then
        kv_at[at], n_at[at] = kv_at[at] + tonumber(kv), n_at[at] + 1
      else
        kv_at[at], n_at[at] = tonumber(kv), 1
        times[#times + 1] = at
      end
    end
  end
  table.sort(times)
  local freed, slots, wait = 0, 0, 1.0
  for _, at in ipairs(times) do
    freed, slots = freed + kv_at[at], slots + n_at[at]
    wait = at - now
    if freed >= kv_needed and slots >= slots_needed then
      break
    end
  end
  return num(math.max(1.0, math.ceil(wait)))
end

local backend_ok = true
if a.kv > a.kvb then
  backend_ok = false
elseif n >= a.mc then
  backend_ok = false
  out.w_slot = until_freed(0, 1, nil)
elseif a.kv > a.kvb - kvin then
  backend_ok = false
  out.w_kv = until_freed(a.kv - (a.kvb - kvin), 0, nil)
end
if conc_hit then
  out.w_tenant = until_freed(0, 1, a.t)
end

local admitted = backend_ok and not enforced
if admitted then
  for _, sc in ipairs(scopes) do
    if sc.r then
      take(sc.r, 1, now)
    end
    if sc.t then
      take(sc.t, a.tk, now)
    end
    sc.n = sc.n + 1
  end
  rs_dh, rs_dl = m_add(rs_dh, rs_dl, cost_h, cost_l)
  rs_mh, rs_ml = m_add(rs_mh, rs_ml, cost_h, cost_l)
  redis.call('HSET', th, 'rs|' .. dk, m_str(rs_dh, rs_dl), 'rs|' .. mk, m_str(rs_mh, rs_ml))
  redis.call('HINCRBY', bk, 'kv', a.kv)
  redis.call('HINCRBY', bk, 'n', 1)
  local keys = {}
  for i, lim in ipairs(a.sc) do
    keys[i] = lim.k
  end
  local rec = rec_encode({
    rid = a.rid, t = a.t, m = a.m, p = a.p, x = a.x, c = a.c, cost = a.cost, kv = a.kv,
    s = num(now), tk = a.tk, sc = keys, dk = dk, mk = mk, b = a.b,
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
-- Refills and synced rules are kept either way, as the memory store keeps them; the
-- tenant-wide buckets are read for the x-ratelimit-* view, which refills them.
for _, sc in ipairs(scopes) do
  if sc.key == '' then
    if sc.r then
      refill(sc.r, now)
    end
    if sc.t then
      refill(sc.t, now)
    end
  end
  scope_save(th, sc)
end
out.ok = admitted
return cjson.encode(out)
