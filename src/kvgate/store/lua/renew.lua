-- kvgate renew: extend live leases, and keep their billing records alive.
-- ARGV[1] prefix, ARGV[2] JSON {l: [[id, backend], ...], ttl, keep, revive}.
-- Returns a list, per lease: 1 extended; 0 lost (settled, abandoned, or past its expiry,
-- swept or not); 2 revived (only with `revive`).
--
-- `revive` (a replica replaying its renewals after a Redis outage): a lease that lapsed
-- during the outage while its request is still open (its billing record is there) is taken
-- again, capacity and tenant hold, as if it had been renewed in time. The request really
-- is still running on its backend, so counting it again is the truth, even if that puts the
-- backend over its budget until it ends.
local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now = clock(a)
local leases = P .. ':leases'
local out = {}
for i, l in ipairs(a.l) do
  local id, b = l[1], l[2]
  local member = b .. '|' .. id
  local expires = redis.call('ZSCORE', leases, member)
  local bill = redis.call('HGET', P .. ':bill', id)
  local state = 0
  if expires and (tonumber(expires) > now or a.revive) then
    redis.call('ZADD', leases, 'XX', num(now + a.ttl), member)
    state = 1
  elseif bill and a.revive and not expires then
    local rec = rec_decode(bill)
    local bk = P .. ':b|' .. b
    redis.call('HINCRBY', bk, 'kv', rec.kv)
    redis.call('HINCRBY', bk, 'n', 1)
    retake_hold(P, rec, now)
    redis.call('HSET', P .. ':r|' .. b, id, bill)
    redis.call('ZADD', leases, num(now + a.ttl), member)
    state = 2
  end
  if bill then
    -- While anyone renews, the request is open: keep its bill however long it runs.
    redis.call('ZADD', P .. ':billx', 'XX', num(now + a.keep), id)
  end
  out[i] = state
end
return out
