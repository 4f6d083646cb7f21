-- kvgate precheck: the pre-check before a prompt is tokenized, taking the tenant's RPM
-- request when it passes (RedisStore.precheck with take_request_slot; without it no script
-- runs). ARGV[1] prefix, ARGV[2] JSON {t, b, tk, cost, sc, bu} (tk and cost: the lower bound).
-- Sweeps expired leases; checks the tenant's limits for the lower bound as reserve does
-- (RPM, TPM, concurrency per scope, the budgets); if no enforced one is broken, takes one
-- request from every scope's RPM bucket, shadowed ones too (policy precheck). A rejection
-- takes nothing. Returns JSON: the state checked (as reserve, so the caller explains a
-- rejection with the policy's own code) and ok (the request was taken).

local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now, wall = clock(a)
local expired = sweep(P, now, 100)
local dk, mk = period_keys(wall)
local th = tenant_key(P, a.t)
local out = { now = num(now), wall = num(wall), dk = dk, mk = mk, exp = expired }
local enforced, conc_hit, scopes = tenant_check(P, th, a, now, dk, mk, out)

-- The backend is only read: the in-flight counts and, for a tenant concurrency
-- rejection, when the tenant's own work is expected to free a slot.
local bv = redis.call('HMGET', P .. ':b|' .. a.b, 'kv', 'n', 'spot', 'otpr')
out.kvin, out.n = tonumber(bv[1]) or 0, tonumber(bv[2]) or 0
if conc_hit then
  out.w_tenant = until_freed(P .. ':r|' .. a.b, bv, now, 0, 1, a.t)
end

scopes_save(th, scopes, now, not enforced)
out.ok = not enforced
return cjson.encode(out)
