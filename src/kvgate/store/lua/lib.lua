-- kvgate: helpers shared by every script. The store prepends this file to each script.
--
-- Every key a script touches is built from ARGV[1], the hash-tagged prefix "{<prefix>}", so
-- all of a deployment's keys live in one Redis Cluster slot and each script is single-slot.
-- KEYS[1] is always <prefix>:leases, which routes the call and lets Cluster check the slot.
--
-- Numbers: Lua 5.1 numbers are doubles. Floats that go back to Python are formatted with
-- %.17g (exact round trip). Money (integer pico-dollars, which exceed 2^53) never becomes a
-- single Lua number: it travels and is stored as a decimal string and is computed on as a
-- pair (hi, lo) = hi * 10^12 + lo with 0 <= lo < 10^12, exact while |hi| < 2^53.

if redis.replicate_commands then
  -- Redis < 5 needs this before writing after TIME; on Redis >= 5 it is a no-op.
  redis.replicate_commands()
end

local B = 1000000000000

local function num(x)
  return string.format('%.17g', x)
end

local function m_norm(hi, lo)
  local carry = math.floor(lo / B)
  return hi + carry, lo - carry * B
end

local function m_parse(s)
  if not s or s == '' then
    return 0, 0
  end
  s = tostring(s)
  local neg = string.sub(s, 1, 1) == '-'
  if neg then
    s = string.sub(s, 2)
  end
  local n = #s
  local hi, lo = 0, tonumber(s)
  if n > 12 then
    hi = tonumber(string.sub(s, 1, n - 12))
    lo = tonumber(string.sub(s, n - 11))
  end
  if neg then
    return m_norm(-hi, -lo)
  end
  return hi, lo
end

local function m_str(hi, lo)
  if hi < 0 then
    -- value = hi*B + lo < 0: print the magnitude
    local h, l = m_norm(-hi, -lo)
    return '-' .. (h == 0 and string.format('%d', l) or string.format('%d%012d', h, l))
  end
  if hi == 0 then
    return string.format('%d', lo)
  end
  return string.format('%d%012d', hi, lo)
end

local function m_add(ah, al, bh, bl)
  return m_norm(ah + bh, al + bl)
end

local function m_sub(ah, al, bh, bl)
  return m_norm(ah - bh, al - bl)
end

-- a > b, both normalised
local function m_gt(ah, al, bh, bl)
  if ah ~= bh then
    return ah > bh
  end
  return al > bl
end

local function hmoney_add(key, field, dh, dl)
  local h, l = m_parse(redis.call('HGET', key, field))
  h, l = m_add(h, l, dh, dl)
  redis.call('HSET', key, field, m_str(h, l))
end

-- The one clock: Redis TIME, unless the caller injected a test clock.
local function clock(a)
  if a.now then
    return a.now, a.wall
  end
  local t = redis.call('TIME')
  local s = tonumber(t[1]) + tonumber(t[2]) / 1000000
  return s, s
end

-- UTC calendar from days since 1970-01-01 (proleptic Gregorian, era arithmetic).
local function civil(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then
    y = y + 1
  end
  return y, m, d
end

-- The budget period keys of a wall time: "YYYY-MM-DD" and "YYYY-MM" (as policy/periods.py).
local function period_keys(wall)
  local y, m, d = civil(math.floor(wall / 86400))
  return string.format('%04d-%02d-%02d', y, m, d), string.format('%04d-%02d', y, m)
end

-- ---------------------------------------------------------------- token buckets
-- Mirrors policy/buckets.py exactly (same double arithmetic, same order of operations).

local function refill(b, now)
  local elapsed = now - b.at
  if elapsed < 0 then
    elapsed = 0
  end
  b.level = math.min(b.cap, b.level + elapsed * b.rate)
  if now > b.at then
    b.at = now
  end
end

local function wait_for(b, amount, now)
  if amount > b.cap then
    return math.huge
  end
  refill(b, now)
  local missing = amount - b.level
  if missing <= 0 then
    return 0
  end
  return missing / b.rate
end

local function take(b, amount, now)
  refill(b, now)
  b.level = b.level - amount
end

local function give_back(b, amount, now)
  refill(b, now)
  b.level = math.min(b.cap, b.level + amount)
end

-- A bucket brought in line with its rule (nil: no rule). A new rule starts full; a changed
-- rule keeps the level (capped), forgiving no debt and granting no fresh burst.
local function sync(b, rule, now)
  if not rule then
    return nil
  end
  if not b then
    return { level = rule[1], at = now, cap = rule[1], rate = rule[2] }
  end
  if b.cap ~= rule[1] or b.rate ~= rule[2] then
    refill(b, now)
    b.cap, b.rate = rule[1], rule[2]
    b.level = math.min(b.level, rule[1])
  end
  return b
end

-- ---------------------------------------------------------------- tenant scopes
-- One hash per tenant: "<scope>|rl" etc. (r = requests bucket, t = tokens bucket:
-- l level, u updated at, c capacity, r refill per s) and "<scope>|n" (in flight).
-- The tenant-wide scope is "", a model scope is the model's name.
--
-- A level scope ("@team:research", "@user:bob", "@key:..."; policy/tenant.py Level) can be
-- one of many (a JWT's users), so it has a hash of its own, "<p>:ls|<tenant>|<scope>" (same
-- fields), which expires once idle: when its buckets would be full again, never while
-- anything is in flight. A level's money per period is "<p>:lm|<tenant>|<scope>|<period>"
-- (sp spent, rs reserved), kept LEVEL_KEEP seconds after its last change (as
-- LEVEL_LEDGER_KEEP_S in policy/tenant.py): longer than a month, so a period's spend
-- outlives the period.

local LEVEL_KEEP = 3456000
-- Seconds an idle level scope outlives the moment its buckets are full again.
local LEVEL_IDLE_GRACE = 60

local function is_level(s)
  return string.sub(s, 1, 1) == '@'
end

local function scope_home(P, tenant, th, s)
  if is_level(s) then
    return P .. ':ls|' .. tenant .. '|' .. s
  end
  return th
end

local function level_money_key(P, tenant, s, period)
  return P .. ':lm|' .. tenant .. '|' .. s .. '|' .. period
end

local function level_money_add(P, tenant, s, period, field, dh, dl, floor_zero)
  local key = level_money_key(P, tenant, s, period)
  local h, l = m_parse(redis.call('HGET', key, field))
  h, l = m_add(h, l, dh, dl)
  if floor_zero and h < 0 then
    h, l = 0, 0
  end
  redis.call('HSET', key, field, m_str(h, l))
  redis.call('EXPIRE', key, LEVEL_KEEP)
end

-- Seconds until a stored bucket is full again at `now`, without refilling it (the saved
-- level must stay what the policy's code computes).
local function seconds_to_full(b, now)
  if not b then
    return 0
  end
  local elapsed = math.max(0, now - b.at)
  local missing = b.cap - math.min(b.cap, b.level + elapsed * b.rate)
  if missing <= 0 then
    return 0
  end
  return missing / b.rate
end

local function scope_load(h, s)
  local v = redis.call('HMGET', h, s .. '|rl', s .. '|ru', s .. '|rc', s .. '|rr',
    s .. '|tl', s .. '|tu', s .. '|tc', s .. '|tr', s .. '|n')
  local sc = { key = s, h = h, n = tonumber(v[9]) or 0 }
  if v[1] then
    sc.r = { level = tonumber(v[1]), at = tonumber(v[2]), cap = tonumber(v[3]), rate = tonumber(v[4]) }
  end
  if v[5] then
    sc.t = { level = tonumber(v[5]), at = tonumber(v[6]), cap = tonumber(v[7]), rate = tonumber(v[8]) }
  end
  return sc
end

local function bucket_save(h, s, kind, b)
  if b then
    redis.call('HSET', h, s .. '|' .. kind .. 'l', num(b.level), s .. '|' .. kind .. 'u', num(b.at),
      s .. '|' .. kind .. 'c', num(b.cap), s .. '|' .. kind .. 'r', num(b.rate))
  else
    redis.call('HDEL', h, s .. '|' .. kind .. 'l', s .. '|' .. kind .. 'u', s .. '|' .. kind .. 'c',
      s .. '|' .. kind .. 'r')
  end
end

local function scope_save(h, sc, now)
  bucket_save(h, sc.key, 'r', sc.r)
  bucket_save(h, sc.key, 't', sc.t)
  redis.call('HSET', h, sc.key .. '|n', sc.n)
  if is_level(sc.key) then
    if sc.n > 0 then
      redis.call('PERSIST', h)
    else
      local idle = math.max(seconds_to_full(sc.r, now), seconds_to_full(sc.t, now))
      redis.call('EXPIRE', h, math.ceil(idle) + LEVEL_IDLE_GRACE)
    end
  end
end

-- Saves every scope after a decision (refills and synced rules are kept either way, as the
-- memory store keeps them). take_request: a passing pre-check takes one request from each
-- RPM bucket; otherwise the tenant-wide buckets are refilled for the x-ratelimit-* view.
local function scopes_save(h, scopes, now, take_request)
  for _, sc in ipairs(scopes) do
    if take_request then
      if sc.r then
        take(sc.r, 1, now)
      end
    elseif sc.key == '' then
      if sc.r then
        refill(sc.r, now)
      end
      if sc.t then
        refill(sc.t, now)
      end
    end
    scope_save(sc.h, sc, now)
  end
end

local function scope_sync(sc, lim, now)
  sc.r = sync(sc.r, lim.r, now)
  sc.t = sync(sc.t, lim.t, now)
end

-- Sync a scope a hold took from to the rules at hand: a level scope they do not name (a
-- sweep or an abandon uses the tenant's last request's rules, whose caller may be another)
-- keeps its buckets as stored (policy/tenant.py TenantState.held_scope).
local function held_sync(sc, limits, now)
  local lim = limits[sc.key]
  if lim or not is_level(sc.key) then
    scope_sync(sc, lim or {}, now)
  end
end

-- ---------------------------------------------------------------- leases
-- A reservation record is "<started> <kv> <max new> <tenant>\n<JSON>": the first line is all
-- the Retry-After estimate reads from every lease (parsed without decoding the JSON).

local function rec_encode(t)
  return t.s .. ' ' .. t.kv .. ' ' .. t.x .. ' ' .. t.t .. '\n' .. cjson.encode(t)
end

local function rec_decode(raw)
  return cjson.decode(string.sub(raw, string.find(raw, '\n', 1, true) + 1))
end

local function tenant_key(P, tenant)
  return P .. ':t|' .. tenant
end

-- Undo what one reservation holds on its tenant: free the slot in every scope, refund the
-- unused tokens (or charge the overshoot), move the money from reserved to spent.
-- `limits` maps scope -> rules of the current policy; nil (a sweep, which has no policy at
-- hand) uses the rules of the tenant's last reservation, as the memory store does.
-- The tenant's rules of its last reservation (what a sweep or an abandon settles against).
local function last_limits(h)
  local limits = {}
  local pol = redis.call('HGET', h, 'pol')
  if pol then
    for _, lim in ipairs(cjson.decode(pol)) do
      limits[lim.k] = lim
    end
  end
  return limits
end

-- `refund_request`: also give the RPM request back if the reserve took it (abandon).
local function release_hold(P, rec, used_tokens, cost_h, cost_l, limits, now, refund_request)
  local h = tenant_key(P, rec.t)
  if not limits then
    limits = last_limits(h)
  end
  for _, s in ipairs(rec.sc) do
    local sc = scope_load(scope_home(P, rec.t, h, s), s)
    held_sync(sc, limits, now)
    sc.n = math.max(0, sc.n - 1)
    -- A request the pre-check took (rec.pre) stays taken: the request was made.
    if refund_request and sc.r and not rec.pre then
      give_back(sc.r, 1, now)
    end
    if sc.t then
      give_back(sc.t, rec.tk - used_tokens, now)
    end
    scope_save(sc.h, sc, now)
  end
  local hold_h, hold_l = m_parse(rec.cost)
  for _, key in ipairs({ rec.dk, rec.mk }) do
    local rh, rl = m_parse(redis.call('HGET', h, 'rs|' .. key))
    rh, rl = m_sub(rh, rl, hold_h, hold_l)
    if rh < 0 then
      rh, rl = 0, 0
    end
    redis.call('HSET', h, 'rs|' .. key, m_str(rh, rl))
    hmoney_add(h, 'sp|' .. key, cost_h, cost_l)
    for _, s in ipairs(rec.lv or {}) do
      level_money_add(P, rec.t, s, key, 'rs', -hold_h, -hold_l, true)
      level_money_add(P, rec.t, s, key, 'sp', cost_h, cost_l, false)
    end
  end
end

-- Bill a request whose lease expired before it settled (policy/tenant.py charge_expired):
-- the expiry gave the hold back as if nothing was used; take what was.
local function charge_expired(P, rec, used_tokens, cost_h, cost_l, limits, now)
  local h = tenant_key(P, rec.t)
  for _, s in ipairs(rec.sc) do
    local sc = scope_load(scope_home(P, rec.t, h, s), s)
    held_sync(sc, limits, now)
    if sc.t then
      take(sc.t, used_tokens, now)
    end
    scope_save(sc.h, sc, now)
  end
  for _, key in ipairs({ rec.dk, rec.mk }) do
    hmoney_add(h, 'sp|' .. key, cost_h, cost_l)
    for _, s in ipairs(rec.lv or {}) do
      level_money_add(P, rec.t, s, key, 'sp', cost_h, cost_l, false)
    end
  end
end

-- Take a swept reservation's hold again (a lease revived after an outage): the reverse of
-- release_hold with nothing used.
local function retake_hold(P, rec, now)
  local h = tenant_key(P, rec.t)
  local limits = last_limits(h)
  for _, s in ipairs(rec.sc) do
    local sc = scope_load(scope_home(P, rec.t, h, s), s)
    held_sync(sc, limits, now)
    sc.n = sc.n + 1
    if sc.t then
      take(sc.t, rec.tk, now)
    end
    scope_save(sc.h, sc, now)
  end
  local cost_h, cost_l = m_parse(rec.cost)
  for _, key in ipairs({ rec.dk, rec.mk }) do
    hmoney_add(h, 'rs|' .. key, cost_h, cost_l)
    for _, s in ipairs(rec.lv or {}) do
      level_money_add(P, rec.t, s, key, 'rs', cost_h, cost_l, false)
    end
  end
end

-- ---------------------------------------------------------------- billing records
-- "<p>:bill" id -> the reservation record (with its backend, "b"), from reserve to the
-- first settle (or abandon): it survives the lease, so an expired request is still billed,
-- and consuming it makes settlement idempotent. "<p>:billx" id -> when it lapses (refreshed
-- by renew). "<p>:rq" "<tenant>|<request id>" -> "<backend>|<id>", for abandon.

local function bill_drop(P, id, rec)
  redis.call('HDEL', P .. ':bill', id)
  redis.call('ZREM', P .. ':billx', id)
  local rq = rec.t .. '|' .. rec.rid
  if redis.call('HGET', P .. ':rq', rq) == rec.b .. '|' .. id then
    redis.call('HDEL', P .. ':rq', rq)
  end
end

-- Forget billing records nobody renewed or settled for their whole retention.
local function bill_sweep(P, now, limit)
  local due = redis.call('ZRANGEBYSCORE', P .. ':billx', '-inf', num(now), 'LIMIT', 0, limit)
  for _, id in ipairs(due) do
    local raw = redis.call('HGET', P .. ':bill', id)
    if raw then
      bill_drop(P, id, rec_decode(raw))
    else
      redis.call('ZREM', P .. ':billx', id)
    end
  end
end

local function release_backend(P, backend, rec)
  local bk = P .. ':b|' .. backend
  redis.call('HINCRBY', bk, 'kv', -rec.kv)
  redis.call('HINCRBY', bk, 'n', -1)
end

-- Free every lease that expired: backend capacity and tenant holds, nothing charged.
-- Returns what was freed so the caller can report it.
local function sweep(P, now, limit)
  local leases = P .. ':leases'
  local due = redis.call('ZRANGEBYSCORE', leases, '-inf', num(now), 'WITHSCORES', 'LIMIT', 0, limit)
  local out = {}
  for i = 1, #due, 2 do
    local member = due[i]
    local bar = string.find(member, '|', 1, true)
    local backend, id = string.sub(member, 1, bar - 1), string.sub(member, bar + 1)
    redis.call('ZREM', leases, member)
    local rk = P .. ':r|' .. backend
    local raw = redis.call('HGET', rk, id)
    if raw then
      redis.call('HDEL', rk, id)
      local rec = rec_decode(raw)
      release_backend(P, backend, rec)
      release_hold(P, rec, 0, 0, 0, nil, now, false)
      out[#out + 1] = { backend, id, due[i + 1], raw }
    end
  end
  bill_sweep(P, now, limit)
  return out
end

-- ---------------------------------------------------------------- admission checks

-- Check the tenant's limits for a request (policy/tenant.py evaluate): every scope's RPM
-- (with `a.pre`, the pre-check took its request already: only a debt breaks it), TPM for
-- `a.tk` tokens and
-- concurrency, then the budgets for `a.cost`. Loads and syncs each scope (refilling exactly
-- when the policy's code would) and records in `out` the state checked, before any refill:
-- `sc` per scope, `sp`/`rs` money spent and reserved per period. Returns whether an enforced
-- limit is broken, whether tenant concurrency is, the loaded scopes and the money as pairs.
local function tenant_check(P, th, a, now, dk, mk, out)
  local enforced, conc_hit = false, false
  local scopes, snap = {}, {}
  for i, lim in ipairs(a.sc) do
    local sc = scope_load(scope_home(P, a.t, th, lim.k), lim.k)
    scope_sync(sc, lim, now)
    local s = { n = sc.n }
    if sc.r then
      s.r = { num(sc.r.level), num(sc.r.at) }
      if wait_for(sc.r, a.pre and 0 or 1, now) > 0 and not lim.r[3] then
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

  local m = {}
  m.sp_dh, m.sp_dl = m_parse(redis.call('HGET', th, 'sp|' .. dk))
  m.rs_dh, m.rs_dl = m_parse(redis.call('HGET', th, 'rs|' .. dk))
  m.sp_mh, m.sp_ml = m_parse(redis.call('HGET', th, 'sp|' .. mk))
  m.rs_mh, m.rs_ml = m_parse(redis.call('HGET', th, 'rs|' .. mk))
  out.sp = { m_str(m.sp_dh, m.sp_dl), m_str(m.sp_mh, m.sp_ml) }
  out.rs = { m_str(m.rs_dh, m.rs_dl), m_str(m.rs_mh, m.rs_ml) }
  m.cost_h, m.cost_l = m_parse(a.cost)
  for _, rule in ipairs(a.bu) do
    if not rule[3] then
      local cap_h, cap_l = m_parse(rule[2])
      local lh, ll
      if rule[1] == 'day' then
        lh, ll = m_sub(cap_h, cap_l, m.sp_dh, m.sp_dl)
        lh, ll = m_sub(lh, ll, m.rs_dh, m.rs_dl)
      else
        lh, ll = m_sub(cap_h, cap_l, m.sp_mh, m.sp_ml)
        lh, ll = m_sub(lh, ll, m.rs_mh, m.rs_ml)
      end
      if m_gt(m.cost_h, m.cost_l, lh, ll) then
        enforced = true
      end
    end
  end

  -- Each level's money (a.lv: its scope keys) and budgets (a.lb: [scope, period, cap,
  -- shadow]), always "block"; `out.lm` per level: spent and reserved, day then month.
  local lm = {}
  out.lm = {}
  for i, s in ipairs(a.lv or {}) do
    local d = redis.call('HMGET', level_money_key(P, a.t, s, dk), 'sp', 'rs')
    local mo = redis.call('HMGET', level_money_key(P, a.t, s, mk), 'sp', 'rs')
    out.lm[i] = { d[1] or '0', d[2] or '0', mo[1] or '0', mo[2] or '0' }
    lm[s] = out.lm[i]
  end
  for _, rule in ipairs(a.lb or {}) do
    if not rule[4] then
      local money = lm[rule[1]]
      local sp, rs = money[1], money[2]
      if rule[2] ~= 'day' then
        sp, rs = money[3], money[4]
      end
      local lh, ll = m_parse(rule[3])
      local sh, sl = m_parse(sp)
      local rh, rl = m_parse(rs)
      lh, ll = m_sub(lh, ll, sh, sl)
      lh, ll = m_sub(lh, ll, rh, rl)
      if m_gt(m.cost_h, m.cost_l, lh, ll) then
        enforced = true
      end
    end
  end
  return enforced, conc_hit, scopes, m
end

-- When enough in-flight work finishes to free what is missing (policy/kv.py
-- seconds_until_freed): in-flight requests in expected finishing order, from the learnt
-- decode speed. `rk` the backend's leases, `bv` its HMGET kv, n, spot, otpr. Only computed
-- for a rejection, so the walk costs nothing on admission. Leases finishing at the same
-- moment are taken together: the answer is that moment either way, and plain numbers sort
-- much faster than pairs.
local function until_freed(rk, bv, now, kv_needed, slots_needed, tenant)
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
