-- kvgate usage: one tenant's ledger and budget money for some periods, in one snapshot.
-- ARGV[1] prefix, ARGV[2] tenant, ARGV[3..] period keys. Returns, per period key:
-- {key, spent, reserved, {field, value, ...} of the ledger hash}.
local P = ARGV[1]
local h = P .. ':t|' .. ARGV[2]
local out = {}
for i = 3, #ARGV do
  local key = ARGV[i]
  local money = redis.call('HMGET', h, 'sp|' .. key, 'rs|' .. key)
  out[#out + 1] = { key, money[1] or '0', money[2] or '0',
    redis.call('HGETALL', P .. ':l|' .. ARGV[2] .. '|' .. key) }
end
return out
