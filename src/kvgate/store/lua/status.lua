-- kvgate status: sweep expired leases, then every backend's capacity in use.
-- ARGV[1] prefix, ARGV[2] JSON {now?, wall?}. Returns JSON {backends: [[name, kv budget,
-- kv in flight, requests in flight, max concurrent]], exp: [swept leases]}.
local P = ARGV[1]
local a = cjson.decode(ARGV[2])
local now = clock(a)
local expired = sweep(P, now, 1000)
local backends = {}
for _, name in ipairs(redis.call('SMEMBERS', P .. ':be')) do
  local v = redis.call('HMGET', P .. ':b|' .. name, 'kvb', 'kv', 'n', 'mc')
  backends[#backends + 1] = { name, tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0,
    tonumber(v[4]) or 0 }
end
return cjson.encode({ backends = backends, exp = expired })
