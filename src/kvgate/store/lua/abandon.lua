-- kvgate abandon: the compensating release of a reserve whose outcome its caller does not
-- know (cancelled, timed out). ARGV[1] prefix, ARGV[2] JSON {t, rid, ab}.
-- Releases what that request's reservation holds (backend capacity, tenant slots, the RPM
-- and TPM tokens, the reserved money; nothing is billed), forgets its billing record, and
-- leaves a tombstone for `ab` seconds so that a reserve for it landing later commits
-- nothing. Idempotent. Returns 1 if a reservation was found, else 0.
local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now = clock(a)
local rq = a.t .. '|' .. a.rid
local ab = P .. ':ab'
redis.call('ZREMRANGEBYSCORE', ab, '-inf', num(now))
redis.call('ZADD', ab, num(now + a.ab), rq)
local ref = redis.call('HGET', P .. ':rq', rq)
if not ref then
  return 0
end
local bar = string.find(ref, '|', 1, true)
local b, id = string.sub(ref, 1, bar - 1), string.sub(ref, bar + 1)
redis.call('HDEL', P .. ':rq', rq)
redis.call('HDEL', P .. ':bill', id)
redis.call('ZREM', P .. ':billx', id)
local rk = P .. ':r|' .. b
local raw = redis.call('HGET', rk, id)
if raw then
  -- Still leased (an expired lease was given back by its sweep already).
  local rec = rec_decode(raw)
  redis.call('HDEL', rk, id)
  redis.call('ZREM', P .. ':leases', b .. '|' .. id)
  release_backend(P, b, rec)
  release_hold(P, rec, 0, 0, 0, nil, now, true)
end
return 1
