"""The fair pick, one Lua script per call: settle, file new entries, sweep, pick.

Every key but the stream is anyone's to break: an operator's cleanup deletes a tenant's
queues, a stray ``HSET`` puts text where a number was, a producer invents a tenant per job.
The stream and its pending list are the truth: the script checks each key's type and value
before it relies on it, repairs what is wrong (a key of another type is deleted, a value out
of range is dropped or reset), reports each repair once (the worker logs it with the key),
and the sweep files again every entry that waits for a pick but sits in no queue. So no
write to these keys loses a job or stops the model's queue; at worst it reorders the waiting
jobs. Validation comes before any write that matters: a script that stops half way leaves
entries pending for ``(fair-queue)`` unfiled, and the next sweep finds them.
"""

from __future__ import annotations

from string import Template
from typing import Final

# Weights an operator may give (``tenant_weights`` hash): a ratio of 10,000 at most.
MIN_WEIGHT: Final = 0.01
MAX_WEIGHT: Final = 100.0
# What a job without ``max_tokens`` is charged at its start (settled at its end).
DEFAULT_COST: Final = 256
# A job's prompt is charged at its start as its bytes / this (about four bytes a token of
# text); its end settles the charge to the prompt tokens the engine computed (not cached).
PROMPT_BYTES_PER_TOKEN: Final = 4
# Virtual time and tags beyond this are no service anyone received (2**50 tokens): garbage.
MAX_TAG: Final = 2.0**50
# A backlogged tenant's start tag further than this from virtual time (10**12 tokens at the
# least weight, more than any backlog of real jobs builds) was written by someone else.
TAG_SPAN: Final = 1e12
# Tenants that join with no record (names never seen, or forgotten) run ahead of virtual
# time by at most this much together: two default jobs join level with everyone, later
# newcomers queue behind them as one tenant of their own weight. A producer that invents a
# name per job gains this much, once, and one share, not a share per name.
NEWCOMER_ALLOWANCE: Final = 2 * DEFAULT_COST
# An idle tenant's record (its last finish tag) is kept while virtual time is within this of
# it (about 16k default jobs of service), for at most MAX_IDLE tenants and IDLE_TTL seconds
# after the model's last pick: so a tenant that comes back is no newcomer, and the set of
# idle tenants does not grow with every name ever used.
FORGET_AFTER: Final = 2.0**22
MAX_IDLE: Final = 10_000
IDLE_TTL_SECONDS: Final = 3600
# Entries of the pending list one sweep call visits at most (as many as one intake decodes:
# a call's bounded work), and the calls one sweep makes at most while they find entries to
# file again (damage is usually a deleted key: many entries at once).
SWEEP_COUNT: Final = 256
SWEEP_CALLS: Final = 8
# Repairs one call reports at most (the rest are repaired as well, and counted).
MAX_REPAIRS_REPORTED: Final = 32


# KEYS: 1 the model's stream, 2 backlogged tenants (zset: start tag), 3 idle tenants' finish
# tags (zset), 4 state (hash: vtime, fresh), 5 weights (hash), 6 this minute's service
# (hash, expiring). Per-tenant queues are ARGV[11]..'q:'..tenant (zset: priority, lower
# first; arrival order within one) and ..'age:'..tenant (zset: arrival ms), in the same slot;
# their members are entry ids with both parts zero-padded to 20 digits, so that members of
# one score sort as the ids do (as text, '5-10' < '5-9'). Unpadded members (queued by an
# older worker) are read as they are. ARGV: 1 group, 2 fair consumer, 3 this worker, 4
# intake count, 5 picks wanted, 6 now in ms (0: Redis' clock), 7 age bound in ms, 8 default
# tenant, 9 max job bytes, 10 default cost, 11 queue key base, 12 served TTL, 13 sweep cursor
# ('-' or '(' .. an entry id), 14 sweep count, 15 number of settlements, then (tenant, tag
# delta, service) for each. Returns {picked, the stream's last id, repairs, sweep cursor,
# entries the sweep filed again}.
class _LuaTemplate(Template):
    delimiter = "@"  # Lua's patterns use "$"


_PICK = _LuaTemplate("""
local stream, backlogged, idle, state, weights, served =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local group, fair, me = ARGV[1], ARGV[2], ARGV[3]
local intake, wanted, now = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local age_bound, default_tenant = tonumber(ARGV[7]), ARGV[8]
local max_bytes, default_cost, base = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]
local sweep_from, sweep_count = ARGV[13], tonumber(ARGV[14])

local repairs, unreported = {}, 0
local function repaired(key, found)
  if #repairs < @MAX_REPAIRS then
    table.insert(repairs, {string.sub(key, 1, 256), string.sub(tostring(found), 1, 64)})
  else
    unreported = unreported + 1
  end
end

-- A key of another type than ours holds nothing we can use: deleted, rebuilt from the stream.
local function own(key, wanted_type)
  local found = redis.call('TYPE', key)['ok']
  if found ~= 'none' and found ~= wanted_type then
    redis.call('DEL', key)
    repaired(key, 'a key of type ' .. found)
  end
end
own(backlogged, 'zset')
own(idle, 'zset')
own(state, 'hash')
own(weights, 'hash')
own(served, 'hash')

local function usable(x)
  return x ~= nil and x == x and x > -@MAX_TAG and x < @MAX_TAG
end

-- The model's clocks: a value that is no number in range is dropped (and rebuilt).
local function clock(field)
  local raw = redis.call('HGET', state, field)
  if not raw then return nil end
  local value = tonumber(raw)
  if usable(value) then return value end
  redis.call('HDEL', state, field)
  repaired(state .. ' ' .. field, raw)
  return nil
end
local vtime = clock('vtime')
if vtime == nil then
  -- Lost or broken: the least start tag waiting is as good a virtual time as any.
  local least = redis.call(
    'ZRANGE', backlogged, '-@MAX_TAG', '@MAX_TAG', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  vtime = least[2] and tonumber(least[2]) or 0
end
local fresh = clock('fresh') or vtime

-- Tags nobody's service explains (inf, or further than the span from virtual time): a
-- backlogged tenant's start is reset to virtual time, an idle tenant's record dropped.
local function reset(low, high)
  local far = redis.call('ZRANGE', backlogged, low, high, 'BYSCORE', 'LIMIT', 0, 16)
  for _, tenant in ipairs(far) do
    redis.call('ZADD', backlogged, vtime, tenant)
    repaired(backlogged .. ' ' .. tenant, 'a start tag out of range')
  end
end
reset('(' .. tostring(vtime + @TAG_SPAN), '+inf')
reset('-inf', '(' .. tostring(vtime - @TAG_SPAN))
local far = redis.call('ZREMRANGEBYSCORE', idle, '(' .. tostring(vtime + @TAG_SPAN), '+inf')
if far > 0 then repaired(idle, far .. ' finish tags out of range') end

local weight_of = {}
local function weight(tenant)
  if weight_of[tenant] then return weight_of[tenant] end
  local raw, w = redis.call('HGET', weights, tenant), 1
  if raw then
    local value = tonumber(raw)
    if value ~= nil and value >= @MIN_WEIGHT and value <= @MAX_WEIGHT then
      w = value
    else  -- the workers' copy: rewritten from the fleet's hash within reclaim_interval
      redis.call('HDEL', weights, tenant)
      repaired(weights .. ' ' .. tenant, raw)
    end
  end
  weight_of[tenant] = w
  return w
end

local function valid_tenant(t)
  return type(t) == 'string' and #t >= 1 and #t <= 128 and not string.find(t, '[^%w%._:%-]')
end

local checked = {}
local function queues(tenant)
  local queue, ages = base .. 'q:' .. tenant, base .. 'age:' .. tenant
  if not checked[tenant] then
    own(queue, 'zset')
    own(ages, 'zset')
    checked[tenant] = true
  end
  return queue, ages
end

local function job_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'job' then
      local data = fields[i + 1]
      if #data > max_bytes then return nil, #data end
      local ok, job = pcall(cmsgpack.unpack, data)
      if ok and type(job) == 'table' then return job, #data end
      return nil, #data
    end
  end
  return nil, 0
end

local function tenant_of(job)
  local t = job and job['tenant']
  if valid_tenant(t) then return t end
  return default_tenant
end

local function integer(value, low, high)
  if type(value) == 'number' and value == math.floor(value) and value >= low and value <= high then
    return value
  end
  return nil
end

-- A job's charge at its start: its max_tokens and its prompt's estimate.
local function charge_of(job, size)
  local top = integer(job and job['max_tokens'], 1, 1e9) or default_cost
  return top + math.ceil(size / @BYTES_PER_TOKEN)
end

local function member_of(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return string.rep('0', 20 - #ms) .. ms .. '-' .. string.rep('0', 20 - #seq) .. seq
end

local function id_of(member)
  local ms, seq = string.match(member, '^(%d+)-(%d+)$')
  if not ms or #ms > 20 or #seq > 20 then return nil end
  return (string.gsub(ms, '^0+(%d)', '%1')) .. '-' .. (string.gsub(seq, '^0+(%d)', '%1'))
end

-- A tenant with none waiting joins at max(V, its last finish tag); one with no record (a
-- newcomer) at the newcomers' clock, which runs ahead of V by at most the allowance.
local function join(tenant, charge)
  if redis.call('ZSCORE', backlogged, tenant) then return end
  local finish = redis.call('ZSCORE', idle, tenant)
  local start
  if finish then
    redis.call('ZREM', idle, tenant)
    start = math.max(vtime, tonumber(finish))
  else
    start = math.max(vtime, fresh - @ALLOWANCE)
    fresh = math.max(fresh, vtime) + charge / weight(tenant)
  end
  redis.call('ZADD', backlogged, start, tenant)
end

local function file(id, fields)
  local job, size = job_of(fields)
  local tenant = tenant_of(job)
  local member = member_of(id)
  local queue, ages = queues(tenant)
  local filed = 0
  if not redis.call('ZSCORE', queue, member) and not redis.call('ZSCORE', queue, id) then
    redis.call('ZADD', queue, integer(job and job['priority'], -100, 100) or 0, member)
    filed = 1
  end
  if not redis.call('ZSCORE', ages, member) and not redis.call('ZSCORE', ages, id) then
    redis.call('ZADD', ages, tonumber(string.match(id, '^(%d+)')), member)
  end
  join(tenant, charge_of(job, size))
  return filed
end

-- Settlements: the difference between a finished job's charge and its service.
local n = tonumber(ARGV[15])
for i = 0, n - 1 do
  local tenant, delta, service = ARGV[16 + 3 * i], tonumber(ARGV[17 + 3 * i]), ARGV[18 + 3 * i]
  local shift = delta / weight(tenant)
  if redis.call('ZSCORE', backlogged, tenant) then
    redis.call('ZINCRBY', backlogged, shift, tenant)
  elseif redis.call('ZSCORE', idle, tenant) then
    redis.call('ZINCRBY', idle, shift, tenant)
  elseif shift > 0 then
    redis.call('ZADD', idle, vtime + shift, tenant)
  end
  local counted = redis.pcall('HINCRBY', served, tenant, service)
  if type(counted) == 'table' and counted['err'] then
    repaired(served .. ' ' .. tenant, redis.call('HGET', served, tenant))
    redis.call('HSET', served, tenant, service)
  end
end
if n > 0 then redis.call('EXPIRE', served, ARGV[12]) end

-- Intake: new entries become pending for the fair consumer, filed in their tenant's queue.
if intake > 0 then
  local read = redis.call(
    'XREADGROUP', 'GROUP', group, fair, 'COUNT', intake, 'STREAMS', stream, '>')
  if read then
    for _, entry in ipairs(read[1][2]) do file(entry[1], entry[2]) end
  end
end

-- Sweep: entries waiting for a pick that no queue holds (a deleted key, a call that stopped
-- half way) are filed again; entries deleted from the stream are acknowledged.
local sweep_next, refiled = sweep_from, 0
if sweep_count > 0 then
  local rows = redis.call('XPENDING', stream, group, sweep_from, '+', sweep_count, fair)
  for _, row in ipairs(rows) do
    local id = row[1]
    local entry = redis.call('XRANGE', stream, id, id)
    if #entry == 0 then
      redis.call('XACK', stream, group, id)
    else
      refiled = refiled + file(id, entry[1][2])
    end
    sweep_next = '(' .. id
  end
  if #rows < sweep_count then sweep_next = '-' end
  if refiled > 0 then repaired(base .. 'q:', refiled .. ' waiting jobs in no queue') end
end

-- Picks: the backlogged tenant with the least start tag; within it, the most urgent job,
-- unless its oldest has waited past the age bound.
local picked = {}
local tries = 0
while #picked < wanted and tries < wanted + 16 do
  tries = tries + 1
  local head = redis.call('ZRANGE', backlogged, 0, 0, 'WITHSCORES')
  if #head == 0 then break end
  local tenant, start = head[1], tonumber(head[2])
  if not valid_tenant(tenant) then
    redis.call('ZREM', backlogged, tenant)
    repaired(backlogged, 'not a tenant: ' .. tenant)
  else
    local queue, ages = queues(tenant)
    local member = nil
    local oldest = redis.call('ZRANGE', ages, 0, 0, 'WITHSCORES')
    if #oldest > 0 and now - tonumber(oldest[2]) >= age_bound then
      member = oldest[1]
    else
      member = redis.call('ZRANGE', queue, 0, 0)[1]
    end
    local cost = 0
    if member then
      redis.call('ZREM', queue, member)
      redis.call('ZREM', ages, member)
      local id = id_of(member)
      if id == nil then
        repaired(queue, 'not an entry id: ' .. member)
      else
        -- Only while it still waits for us: a worker that reclaimed it (one without fair
        -- share) runs it already; a deleted entry is gone.
        local waiting = redis.call('XPENDING', stream, group, id, id, 1, fair)
        local rows = redis.call('XRANGE', stream, id, id)
        if #waiting == 1 and #rows == 1 then
          local job, size = job_of(rows[1][2])
          local owner = tenant_of(job)
          if owner ~= tenant then
            -- Filed under another tenant by someone else: back to its own, charged there.
            file(id, rows[1][2])
            repaired(queue, 'an entry of tenant ' .. owner)
          else
            redis.call('XCLAIM', stream, group, me, 0, id, 'JUSTID')
            cost = charge_of(job, size)
            table.insert(picked, {id, rows[1][2], tenant, tostring(cost)})
          end
        elseif #waiting == 1 then
          redis.call('XACK', stream, group, id)
        end
      end
    end
    if start > vtime then vtime = start end
    local finish = start + cost / weight(tenant)
    if redis.call('EXISTS', queue) == 1 then
      redis.call('ZADD', backlogged, finish, tenant)
    else
      redis.call('ZREM', backlogged, tenant)
      redis.call('ZADD', idle, finish, tenant)
    end
  end
end
redis.call('HSET', state, 'vtime', tostring(vtime), 'fresh', tostring(math.max(fresh, vtime)))
-- Idle records are forgotten once virtual time is far past them, beyond the most recent
-- MAX_IDLE, and with the whole set an hour after the model's last pick.
redis.call('ZREMRANGEBYSCORE', idle, '-inf', '(' .. tostring(vtime - @FORGET_AFTER))
redis.call('ZREMRANGEBYRANK', idle, 0, -(@MAX_IDLE + 1))
redis.call('EXPIRE', idle, @IDLE_TTL)
if unreported > 0 then repaired(base, unreported .. ' more repairs') end
local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
return {picked, last[1] and last[1][1] or '0-0', repairs, sweep_next, refiled}
""")

PICK: Final = _PICK.substitute(
    MAX_REPAIRS=MAX_REPAIRS_REPORTED,
    MAX_TAG=f"{MAX_TAG:.0f}",
    TAG_SPAN=f"{TAG_SPAN:.0f}",
    MIN_WEIGHT=MIN_WEIGHT,
    MAX_WEIGHT=MAX_WEIGHT,
    BYTES_PER_TOKEN=PROMPT_BYTES_PER_TOKEN,
    ALLOWANCE=NEWCOMER_ALLOWANCE,
    FORGET_AFTER=f"{FORGET_AFTER:.0f}",
    MAX_IDLE=MAX_IDLE,
    IDLE_TTL=IDLE_TTL_SECONDS,
)

# KEYS[1] the model's copy of the tenant weights; ARGV: (tenant, weight) pairs, the fleet's
# usable weights. Rewritten (in one step: a pick never sees half a copy) only when it differs:
# an entry changed, added, dropped, or written by someone else. 1: rewritten.
COPY_WEIGHTS: Final = """
local kind = redis.call('TYPE', KEYS[1])['ok']
local same = (kind == 'hash' or kind == 'none') and redis.call('HLEN', KEYS[1]) == #ARGV / 2
if same then
  for i = 1, #ARGV, 2 do
    if redis.call('HGET', KEYS[1], ARGV[i]) ~= ARGV[i + 1] then
      same = false
      break
    end
  end
end
if same then return 0 end
redis.call('DEL', KEYS[1])
if #ARGV > 0 then redis.call('HSET', KEYS[1], unpack(ARGV)) end
return 1
"""
