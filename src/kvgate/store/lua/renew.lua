-- kvgate renew: extend a live stream's lease. ARGV[1] prefix, ARGV[2] JSON {id, b, ttl}.
-- Returns 1, or 0 when the reservation is gone (settled, or expired and swept).
local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now = clock(a)
local member = a.b .. '|' .. a.id
if redis.call('ZSCORE', P .. ':leases', member) then
  redis.call('ZADD', P .. ':leases', 'XX', num(now + a.ttl), member)
  return 1
end
return 0
