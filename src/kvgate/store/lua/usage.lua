-- kvgate usage: one tenant's ledger and budget money for some periods, in one snapshot.
-- ARGV[1] prefix, ARGV[2] tenant, ARGV[3] JSON list of level scope keys, ARGV[4..] period
-- keys. Returns, per period key: {key, spent, reserved, {field, value, ...} of the ledger
-- hash, {spent of each level, in the order given}}.
local P = ARGV[1]
local h = P .. ':t|' .. ARGV[2]
local levels = cjson.decode(ARGV[3])
local out = {}
for i = 4, #ARGV do
  local key = ARGV[i]
  local money = redis.call('HMGET', h, 'sp|' .. key, 'rs|' .. key)
  local spent = {}
  for j, s in ipairs(levels) do
    spent[j] = redis.call('HGET', P .. ':lm|' .. ARGV[2] .. '|' .. s .. '|' .. key, 'sp') or '0'
  end
  out[#out + 1] = { key, money[1] or '0', money[2] or '0',
    redis.call('HGETALL', P .. ':l|' .. ARGV[2] .. '|' .. key), spent }
end
return out
