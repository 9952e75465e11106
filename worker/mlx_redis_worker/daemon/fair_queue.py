"""Fair share of one model's slots between tenants, kept in Redis for every worker of the model.

Producers still ``XADD`` to the model's stream. A worker with fair share on never reads it
with ``XREADGROUP >`` for itself: its pick script first moves new entries into the group's
pending list under the fair consumer (``FAIR_CONSUMER``, not a worker id), filing each entry's
id in its tenant's queue, then chooses the waiting job to start by start-time fair queuing
(SFQ) and hands that entry over to the worker with ``XCLAIM``. The entry never leaves the
stream, so leases, reclaim, dead letters, attempt fences and acknowledgement stay as they are.

Why start-time fair queuing, not deficit round robin: a job's cost (its tokens) is known
only when it ends, and DRR needs it to decide whether a job fits a tenant's deficit. SFQ
charges an estimate at the start (``max_tokens``) and settles the difference at the end
(``FairQueue.settle``), and its bound holds for any cost: while two tenants are backlogged,
their service divided by their weights never differs by more than one largest job each. A
tenant that was idle comes back at the current virtual time (``max(V, F)``): idling banks no
credit, so the window of service that counts is the time a tenant has jobs waiting.

The Redis layout (all keys tagged with the model's name, so on a Cluster they share the
stream's slot and one script sees them all) is spelled out in protocol/README.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog

from mlx_redis_protocol.codec_job import readable_request_id
from mlx_redis_protocol.connection import RedisClient, as_text
from mlx_redis_protocol.constants import DEFAULT_TENANT, FORWARDED_FROM_FIELD, JOB_FIELD
from mlx_redis_protocol.fair_share import (
    SERVED_WINDOW_SECONDS,
    TenantShare,
    served_bucket,
    tenant_shares,
)
from mlx_redis_protocol.identifiers import is_valid_id
from mlx_redis_protocol.keys import FairKeys, JobStream
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.lua import run_script
from mlx_redis_protocol.wire import top_level_strings
from mlx_redis_worker.daemon.job_queue import Delivery

log = structlog.get_logger(__name__)

# The consumer that holds jobs waiting for a fair pick. Not a valid worker id (parentheses),
# so no worker can be it, and ``group prune`` never removes it (it holds pending entries).
FAIR_CONSUMER: Final = "(fair-queue)"
# New entries one pick call files at most: bounds the script's run time; a larger backlog is
# filed over the next calls. While every slot is busy, a worker files new entries every
# read_block_ms (more per call: nothing waits for a slot meanwhile), so a job queued behind a
# long backlog is seen by the next pick, not after backlog / INTAKE picks.
INTAKE: Final = 256
INTAKE_WHILE_BUSY: Final = 1024
# What a job without ``max_tokens`` is charged at its start (settled at its end).
DEFAULT_COST: Final = 256
# Weights an operator may give (``tenant_weights`` hash): a ratio of 10,000 at most.
MIN_WEIGHT: Final = 0.01
MAX_WEIGHT: Final = 100.0
MAX_WEIGHTS: Final = 1000

# KEYS[1] the model's stream, KEYS[2] backlogged tenants (zset: start tag), KEYS[3] idle
# tenants' finish tags (zset), KEYS[4] state (hash: vtime), KEYS[5] weights (hash), KEYS[6]
# this minute's served tokens (hash, expiring). Per-tenant queues are ARGV[11]..'q:'..tenant
# (zset: priority, lower first; arrival order within one) and ..'age:'..tenant (zset: arrival
# ms), in the same slot (same tag); their members are entry ids with both parts zero-padded to
# 20 digits, so that members of one score sort as the ids do (as text, '5-10' < '5-9').
# Unpadded members (queued by an older worker) are read as they are. ARGV: 1 group, 2 fair
# consumer, 3 this worker, 4 intake count, 5 picks wanted, 6 now in ms (0: Redis' clock), 7 age
# bound in ms, 8 default tenant, 9 max job bytes, 10 default cost, 11 queue key base, 12 served
# TTL, 13 number of settlements, then (tenant, token delta, tokens served) for each.
PICK: Final = """
local stream, backlogged, idle, state, weights = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group, fair, me = ARGV[1], ARGV[2], ARGV[3]
local now = tonumber(ARGV[6])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local age_bound, default_tenant = tonumber(ARGV[7]), ARGV[8]
local max_bytes, default_cost, base = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]
local vtime = tonumber(redis.call('HGET', state, 'vtime') or '0')

local function weight(tenant)
  local w = tonumber(redis.call('HGET', weights, tenant) or '')
  if w == nil or w ~= w or w <= 0 then return 1 end
  return w
end

local function job_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'job' then
      local data = fields[i + 1]
      if #data > max_bytes then return nil end
      local ok, job = pcall(cmsgpack.unpack, data)
      if ok and type(job) == 'table' then return job end
      return nil
    end
  end
  return nil
end

local function tenant_of(job)
  local t = job and job['tenant']
  if type(t) == 'string' and #t >= 1 and #t <= 128 and not string.find(t, '[^%w%._:%-]') then
    return t
  end
  return default_tenant
end

local function member_of(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return string.rep('0', 20 - #ms) .. ms .. '-' .. string.rep('0', 20 - #seq) .. seq
end

local function id_of(member)
  local ms, seq = string.match(member, '^(%d+)-(%d+)$')
  return (string.gsub(ms, '^0+(%d)', '%1')) .. '-' .. (string.gsub(seq, '^0+(%d)', '%1'))
end

local function integer(value, low, high)
  if type(value) == 'number' and value == math.floor(value) and value >= low and value <= high then
    return value
  end
  return nil
end

-- Settlements: the difference between a finished job's charge and its tokens.
local n = tonumber(ARGV[13])
for i = 0, n - 1 do
  local tenant, delta = ARGV[14 + 3 * i], tonumber(ARGV[15 + 3 * i])
  local shift = delta / weight(tenant)
  if redis.call('ZSCORE', backlogged, tenant) then
    redis.call('ZINCRBY', backlogged, shift, tenant)
  elseif redis.call('ZSCORE', idle, tenant) then
    redis.call('ZINCRBY', idle, shift, tenant)
  elseif shift > 0 then
    redis.call('ZADD', idle, vtime + shift, tenant)
  end
  redis.call('HINCRBY', KEYS[6], tenant, ARGV[16 + 3 * i])
end
if n > 0 then redis.call('EXPIRE', KEYS[6], ARGV[12]) end

-- Intake: new entries become pending for the fair consumer, filed in their tenant's queue.
local read = redis.call(
  'XREADGROUP', 'GROUP', group, fair, 'COUNT', ARGV[4], 'STREAMS', stream, '>')
if read then
  for _, entry in ipairs(read[1][2]) do
    local id, fields = entry[1], entry[2]
    local job = job_of(fields)
    local tenant = tenant_of(job)
    local priority = integer(job and job['priority'], -100, 100) or 0
    local member = member_of(id)
    redis.call('ZADD', base .. 'q:' .. tenant, priority, member)
    redis.call('ZADD', base .. 'age:' .. tenant, tonumber(string.match(id, '^(%d+)')), member)
    if not redis.call('ZSCORE', backlogged, tenant) then
      local finish = tonumber(redis.call('ZSCORE', idle, tenant) or '-inf')
      redis.call('ZREM', idle, tenant)
      redis.call('ZADD', backlogged, math.max(vtime, finish), tenant)
    end
  end
end

-- Picks: the backlogged tenant with the least start tag; within it, the most urgent job,
-- unless its oldest has waited past the age bound.
local picked = {}
local tries = 0
while #picked < tonumber(ARGV[5]) and tries < tonumber(ARGV[5]) + 16 do
  tries = tries + 1
  local head = redis.call('ZRANGE', backlogged, 0, 0, 'WITHSCORES')
  if #head == 0 then break end
  local tenant, start = head[1], tonumber(head[2])
  local queue, ages = base .. 'q:' .. tenant, base .. 'age:' .. tenant
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
    -- Only while it still waits for us: a worker that reclaimed it (one without fair share)
    -- runs it already; a deleted entry is gone.
    local waiting = redis.call('XPENDING', stream, group, id, id, 1, fair)
    local rows = redis.call('XRANGE', stream, id, id)
    if #waiting == 1 and #rows == 1 then
      redis.call('XCLAIM', stream, group, me, 0, id, 'JUSTID')
      local job = job_of(rows[1][2])
      cost = integer(job and job['max_tokens'], 1, 1e9) or default_cost
      table.insert(picked, {id, rows[1][2], tenant, tostring(cost)})
    elseif #waiting == 1 then
      redis.call('XACK', stream, group, id)
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
redis.call('HSET', state, 'vtime', tostring(vtime))
-- An idle tenant whose finish tag virtual time has passed would come back at vtime anyway.
redis.call('ZREMRANGEBYSCORE', idle, '-inf', '(' .. tostring(vtime))
local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
return {picked, last[1] and last[1][1] or '0-0'}
"""


@dataclass(frozen=True, slots=True)
class Charge:
    """What a started job was charged to its tenant (0 for one not started by a pick: a
    reclaimed or restarted job, charged what it generates)."""

    tenant: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Picked:
    deliveries: list[Delivery]
    charges: dict[str, Charge]  # by entry id
    last_id: str  # the stream's newest entry: wait for entries after it


class FairQueue:
    """One model's fair pick, for one worker: what it charged each job running here, and the
    settlements to send with the next pick (one round trip for both)."""

    def __init__(
        self,
        *,
        redis: RedisClient,
        stream: JobStream,
        keys: FairKeys,
        consumer: str,
        tenant_weights_key: str,
        age_bound_seconds: float,
        max_job_bytes: int = DEFAULT_LIMITS.max_message_bytes,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.keys = keys
        self.consumer = consumer
        self.age_bound_ms = int(age_bound_seconds * 1000)
        self.max_job_bytes = max_job_bytes
        self.tenant_weights_key = tenant_weights_key
        self.running: dict[str, _Running] = {}  # by entry id: jobs running here
        self._entry_of: dict[str, str] = {}  # request id -> entry id, of those
        self._weights: dict[str, float] | None = None
        self._settlements: list[tuple[str, int, int]] = []  # (tenant, delta, served)

    async def pick(self, count: int, *, now_ms: int = 0, intake: int = INTAKE) -> Picked:
        """Up to ``count`` jobs to start now, handed to this worker (pending for it, delivery
        count unchanged), after filing up to ``intake`` new entries; ``now_ms`` 0 is Redis'
        clock (tests simulate time)."""
        settlements, self._settlements = self._settlements, []
        flat = [str(item) for settlement in settlements for item in settlement]
        try:
            reply: Any = await run_script(
                self.redis,
                PICK,
                [
                    self.stream.stream,
                    self.keys.backlogged,
                    self.keys.idle,
                    self.keys.state,
                    self.keys.weights,
                    self.keys.served(served_bucket(time.time())),
                ],
                [
                    self.stream.group,
                    FAIR_CONSUMER,
                    self.consumer,
                    intake,
                    count,
                    now_ms,
                    self.age_bound_ms,
                    DEFAULT_TENANT,
                    self.max_job_bytes,
                    DEFAULT_COST,
                    self.keys.queue_base,
                    SERVED_WINDOW_SECONDS,
                    len(settlements),
                    *flat,
                ],
            )
        except BaseException:
            # Not sent (or its reply lost): send them with the next pick. A lost reply that
            # ran settles twice, an error of one job's tokens in the tenant's tag.
            self._settlements = settlements + self._settlements
            raise
        deliveries, charges = [], {}
        for entry_id, fields, tenant, cost in reply[0]:
            delivery = _delivery(as_text(entry_id), fields)
            deliveries.append(delivery)
            charges[delivery.entry_id] = Charge(as_text(tenant), int(as_text(cost)))
        return Picked(deliveries, charges, as_text(reply[1]))

    def started(self, delivery: Delivery, charge: Charge | None) -> None:
        """A job starts here with what its pick charged (None: not picked; reclaimed or
        restarted, charged what it generates): settled when it ends."""
        if charge is None:
            charge = Charge(readable_tenant(delivery.job_bytes), 0)
        request_id = readable_request_id(delivery.job_bytes)
        self.running[delivery.entry_id] = _Running(charge, request_id)
        if request_id is not None:
            self._entry_of[request_id] = delivery.entry_id

    def closed(self, request_id: str, tokens: int) -> None:
        """The publisher's word: the request's events end after ``tokens`` completion tokens
        (a request of another lane is not ours: ignored)."""
        entry_id = self._entry_of.get(request_id)
        if entry_id is not None and entry_id in self.running:
            self.running[entry_id].tokens += tokens

    def ended(self, entry_id: str) -> None:
        """The job's task ended: its tenant's tag moves by the difference between its charge
        and its tokens, sent with the next pick. A job nobody can follow (no readable request
        id) keeps its charge."""
        running = self.running.pop(entry_id, None)
        if running is None:
            return
        if running.request_id is not None:
            self._entry_of.pop(running.request_id, None)
            tenant, charged = running.charge.tenant, running.charge.tokens
            self._settlements.append((tenant, running.tokens - charged, running.tokens))

    def running_by_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for running in self.running.values():
            tenant = running.charge.tenant
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    async def shares(self) -> list[dict[str, Any]]:
        """Per tenant of this model: jobs waiting (fleet-wide), running here, tokens served
        over the last ten minutes (fleet-wide); for ``stats`` and the metrics."""
        running = self.running_by_tenant()
        shares = await tenant_shares(self.redis, self.keys)
        listed = {share.tenant for share in shares}
        shares += [TenantShare(t, 0, 0) for t in sorted(running) if t not in listed]
        return [{**share.as_dict(), "running": running.get(share.tenant, 0)} for share in shares]

    async def wait_for_new(self, after_id: str, block_ms: int) -> None:
        """Return once an entry newer than ``after_id`` is in the stream, or after
        ``block_ms``: the pick found nothing, and only a new entry brings more."""
        await self.redis.xread({self.stream.stream: after_id}, count=1, block=block_ms)

    async def refresh_weights(self) -> dict[str, float]:
        """Copy the fleet's tenant weights into this model's slot (where the pick script reads
        them) when they changed; the weights in force."""
        weights = parse_weights(await self.redis.hgetall(self.tenant_weights_key))
        if weights != self._weights:
            # The new weights first, then those dropped: a pick in between sees no tenant
            # without its weight (every worker writes the same copy).
            copied: Any = await self.redis.hkeys(self.keys.weights)
            dropped = [name for name in copied if as_text(name) not in weights]
            async with self.redis.pipeline(transaction=False) as pipe:
                if weights:
                    pipe.hset(self.keys.weights, mapping={t: str(w) for t, w in weights.items()})
                if dropped:
                    pipe.hdel(self.keys.weights, *dropped)
                await pipe.execute()
            log.info("tenant_weights_changed", model=self.stream.model, weights=weights)
            self._weights = weights
        return weights


@dataclass(slots=True)
class _Running:
    charge: Charge
    request_id: str | None
    tokens: int = 0


def readable_tenant(job_bytes: bytes | None) -> str:
    """The job's tenant, read as the pick script reads it: the default for anything else."""
    tenant = top_level_strings(job_bytes, ("tenant",)).get("tenant")
    return tenant if tenant is not None and is_valid_id(tenant) else DEFAULT_TENANT


def parse_weights(raw: Mapping[Any, Any]) -> dict[str, float]:
    """The usable entries of the fleet's ``tenant_weights`` hash (others are logged, ignored)."""
    weights: dict[str, float] = {}
    for name, value in list(raw.items())[:MAX_WEIGHTS]:
        tenant, text = as_text(name), as_text(value)
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not is_valid_id(tenant) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            log.warning("tenant_weight_ignored", tenant=tenant[:128], weight=text[:32])
            continue
        weights[tenant] = weight
    return weights


def _delivery(entry_id: str, fields: list[Any]) -> Delivery:
    pairs = {as_text(fields[i]): fields[i + 1] for i in range(0, len(fields) - 1, 2)}
    job = pairs.get(JOB_FIELD)
    origin = pairs.get(FORWARDED_FROM_FIELD)
    return Delivery(
        entry_id=entry_id,
        job_bytes=job if isinstance(job, bytes) else None,
        times_delivered=1,
        forwarded_from=as_text(origin) if isinstance(origin, bytes) else None,
    )
