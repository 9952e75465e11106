"""The quota scripts (Lua, run by SHA1): admission, lease refresh and token charges, over
each API key's buckets and leases in Redis (``mlxw:quota:{name}…``, protocol/README.md)."""

from __future__ import annotations

from typing import Final

# A bucket's level now (full when new): KEYS[n] a hash (tokens, at ms), ``size`` a minute's
# worth, refilled continuously. Shared by ADMIT and token_meter's CHARGE.
BUCKET_LEVEL: Final = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local function level(key, size)
  if size <= 0 then return 0 end
  local state = redis.call('HMGET', key, 'tokens', 'at')
  local tokens = tonumber(state[1]) or size
  local at = tonumber(state[2]) or now
  return math.min(size, tokens + math.max(now - at, 0) * size / 60000)
end
-- Store a bucket's level, kept until a minute after it would be full again.
local function store(key, size, tokens)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at', now)
  redis.call('PEXPIRE', key, math.ceil((size - tokens) * 60000 / size) + 60000)
end
"""

# KEYS[1] the request bucket, KEYS[2] the in-flight leases (zset: request id → expiry ms),
# KEYS[3] the token bucket. ARGV[1] requests per minute (0: no limit), ARGV[2] max in flight
# (0: no cap), ARGV[3] the lease's id, ARGV[4] lease ms, ARGV[5] (may be empty) a lease that,
# when held, makes this one need no slot of its own, ARGV[6] tokens per minute (0: no limit),
# ARGV[7] the request's token charge (its prompt's bound). Returns {verdict, figure, request
# bucket's level, token bucket's level} (levels as text, after the verdict): {0, 0} admitted,
# {1, wait_ms} over the request rate, {3, wait_ms} over the token rate (the longer wait of the
# two names the limit), {2, in_flight} over the cap. A request is admitted by tokens when the
# bucket holds its charge, or is full (a charge above a minute's worth then leaves it in debt).
ADMIT: Final = (
    BUCKET_LEVEL
    + """
local rate, cap, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local tpm, charge = tonumber(ARGV[6]), tonumber(ARGV[7])
local requests, tokens = level(KEYS[1], rate), level(KEYS[3], tpm)
local function reply(verdict, figure)
  return {verdict, figure, tostring(requests), tostring(tokens)}
end
if cap > 0 and ARGV[5] ~= '' then
  local held = redis.call('ZSCORE', KEYS[2], ARGV[5])
  if held and tonumber(held) > now then
    cap = 0
  end
end
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local in_flight = redis.call('ZCARD', KEYS[2])
  if in_flight >= cap then
    return reply(2, in_flight)
  end
end
local wait_requests, wait_tokens = 0, 0
if rate > 0 and requests < 1 then
  wait_requests = math.ceil((1 - requests) * 60000 / rate)
end
if tpm > 0 and tokens < math.min(charge, tpm) then
  wait_tokens = math.ceil((math.min(charge, tpm) - tokens) * 60000 / tpm)
end
if wait_tokens > wait_requests then
  return reply(3, wait_tokens)
end
if wait_requests > 0 then
  return reply(1, wait_requests)
end
if rate > 0 then
  requests = requests - 1
  store(KEYS[1], rate, requests)
end
if tpm > 0 then
  tokens = tokens - charge
  store(KEYS[3], tpm, tokens)
end
if cap > 0 then
  redis.call('ZADD', KEYS[2], now + lease, ARGV[3])
  redis.call('PEXPIRE', KEYS[2], lease * 2)
end
return reply(0, 0)
"""
)

# KEYS[1] the in-flight leases; ARGV[1] lease ms, ARGV[2..] request ids still running here.
REFRESH: Final = """
local t = redis.call('TIME')
local expiry = t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return 0
"""


# KEYS[1] a key's token bucket; ARGV[1] tokens per minute, ARGV[2] tokens to take (less than
# zero: to give back, never past a full bucket). Returns its level (text).
CHARGE: Final = (
    BUCKET_LEVEL
    + """
local size = tonumber(ARGV[1])
local tokens = math.min(size, level(KEYS[1], size) - tonumber(ARGV[2]))
store(KEYS[1], size, tokens)
return tostring(tokens)
"""
)
