"""The fleet's registry: which workers may be alive and which models the fleet has, found
without scanning the keyspace.

Two sorted sets in the default job stream's slot (their hash tag is its name, as for its dead
letters), so a reader finds them with two commands to one node however many keys Redis holds:

* ``mlxw:workers:{mlxw:jobs}``: worker id -> its heartbeat's expiry (ms of Redis' clock).
  Every heartbeat registers the worker again, and drops members that expired over
  ``PRUNE_GRACE_MS`` ago (workers that died). A member is a candidate only: the heartbeat key,
  with its TTL, stays the truth of whether a worker lives, so readers GET the members' keys.
* ``mlxw:models:{mlxw:jobs}``: model name -> when a worker last advertised it (or a producer
  queued for it without checking the catalogue). It lists the model streams a catalogue shows.

Readers take at most ``MAX_REGISTRY_READ`` members of each, the newest first, and none scored
more than ``MAX_AHEAD_MS`` ahead (no worker's heartbeat lives that long): a registry that a
confused writer filled (4,096 members scored ``+inf``) cannot make a read unbounded or hide
the live workers. Every registration repairs what it finds: a registry key of another type (a
stray ``SET``) is replaced, members that would never expire are dropped; a reader that finds
a key of another type waits up to ``REPAIR_WAIT_SECONDS`` for a worker's next heartbeat to
repair it, rather than tell its caller that nobody serves anything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from redis.exceptions import ResponseError

from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.identifiers import is_valid_id
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script

# A member whose expiry passed this long ago is dropped by the next registration: long enough
# that a writer whose clock lags Redis' (one that registers with ZADD, not this script) is
# never dropped while its heartbeat lives.
PRUNE_GRACE_MS: Final = 60_000
# The most members of each registry a reader takes (newest first).
MAX_REGISTRY_READ: Final = 4096
# The longest a heartbeat may live (a worker's heartbeat_ttl is at most this): a member scored
# further ahead (a worker's expiry, a model's last advertisement) is garbage, dropped by every
# registration and skipped by readers (who allow their own clock this much skew as well).
MAX_AHEAD_MS: Final = 3_600_000
# How long a reader waits for a worker to repair a registry key of another type.
REPAIR_WAIT_SECONDS: Final = 10.0
_REPAIR_POLL_SECONDS: Final = 0.25

# KEYS: workers, models. ARGV: worker id, heartbeat TTL in ms, grace in ms, the most ahead in
# ms, served models... Redis' own clock, so every worker's expiries compare on one clock. ZADD
# before the prune: a full Redis (noeviction) refuses the ZADD (its error is raised), and then
# nobody's member is dropped either. A registry key of another type is replaced (a pcall, not
# TYPE: no command beyond the ones the minimum ACL grants). Returns the keys replaced and how
# many workers the registry lists (a worker in a large fleet registers less often).
REGISTER_WORKER: Final = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local replaced = {}
local function zadd(key, score, member)
  local added = redis.pcall('ZADD', key, score, member)
  if type(added) == 'table' and added['err'] then
    if not string.find(added['err'], 'WRONGTYPE', 1, true) then
      return redis.error_reply(added['err'])
    end
    redis.call('DEL', key)
    table.insert(replaced, key)
    redis.call('ZADD', key, score, member)
  end
end
local failed = zadd(KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if failed then return failed end
for i = 5, #ARGV do
  failed = zadd(KEYS[2], now, ARGV[i])
  if failed then return failed end
end
local ahead = '(' .. (now + tonumber(ARGV[4]))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[3])))
redis.call('ZREMRANGEBYSCORE', KEYS[1], ahead, '+inf')
redis.call('ZREMRANGEBYSCORE', KEYS[2], ahead, '+inf')
return {replaced, redis.call('ZCARD', KEYS[1])}
"""

# KEYS: models. ARGV: model. Adds a model nobody advertised yet (a producer queueing for it
# unchecked), so a catalogue shows its queue; an advertised one keeps its time.
REGISTER_MODEL: Final = """
local clock = redis.call('TIME')
return redis.call('ZADD', KEYS[1], 'NX', tonumber(clock[1]) * 1000, ARGV[1])
"""


@dataclass(frozen=True, slots=True)
class Registered:
    """What the registry lists: worker ids and model names, valid ids only, newest first."""

    workers: tuple[str, ...]
    models: tuple[str, ...]
    # Registry keys of another type (a stray SET) that no worker repaired while we waited.
    unreadable: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Registration:
    """What a worker's registration found: the registry keys of another type it replaced,
    and how many workers the registry lists now (the dead not yet pruned included)."""

    replaced: list[str]
    workers: int


async def register_worker(
    redis: RedisClient, keys: Keys, worker_id: str, ttl_ms: int, models: Sequence[str]
) -> Registration:
    """Register the worker (until ``ttl_ms`` from now) and the models it serves; drop the
    members of workers that died and those that would never expire."""
    reply: Any = await run_script(
        redis,
        REGISTER_WORKER,
        [keys.workers, keys.models],
        [worker_id, ttl_ms, PRUNE_GRACE_MS, MAX_AHEAD_MS, *models],
    )
    replaced, workers = reply
    return Registration(
        replaced=[key.decode() if isinstance(key, bytes) else str(key) for key in replaced],
        workers=int(workers),
    )


async def unregister_worker(redis: RedisClient, keys: Keys, worker_id: str) -> None:
    """Take a stopping worker out of the registry (its heartbeat key goes with it)."""
    await redis.zrem(keys.workers, worker_id)


async def register_model(redis: RedisClient, keys: Keys, model: str) -> None:
    """List ``model`` in the catalogue (a producer queueing for it without a check)."""
    await run_script(redis, REGISTER_MODEL, [keys.models], [model])


async def read_registry(
    redis: RedisClient, keys: Keys, *, repair_wait: float = REPAIR_WAIT_SECONDS
) -> Registered:
    """The registered workers and models: one round trip (both are in one slot), more only
    while a registry key is of another type (up to ``repair_wait`` seconds, the time a live
    worker's heartbeat takes to repair it)."""
    deadline = time.monotonic() + repair_wait
    while True:
        registered = await _read_once(redis, keys)
        if not registered.unreadable or time.monotonic() >= deadline:
            return registered
        await asyncio.sleep(_REPAIR_POLL_SECONDS)


async def _read_once(redis: RedisClient, keys: Keys) -> Registered:
    # Scores within the most ahead a heartbeat lives (this host's clock, allowed as much
    # skew again): members scored +inf cannot fill the read. ZRANGE … BYSCORE REV (Redis >=
    # 6.2), not ZREVRANGEBYSCORE: one command for an ACL to grant.
    newest = int(time.time() * 1000) + 2 * MAX_AHEAD_MS
    async with redis.pipeline(transaction=False) as pipe:
        for registry in (keys.workers, keys.models):
            pipe.execute_command(
                "ZRANGE", registry, newest, "-inf", "BYSCORE", "REV", "LIMIT", 0, MAX_REGISTRY_READ
            )
        workers, models = await pipe.execute(raise_on_error=False)
    unreadable = tuple(
        key
        for key, reply in ((keys.workers, workers), (keys.models, models))
        if isinstance(reply, ResponseError) and "WRONGTYPE" in str(reply)
    )
    return Registered(workers=_ids(workers), models=_ids(models), unreadable=unreadable)


def _ids(members: object) -> tuple[str, ...]:
    """The members that are ids, in order, once. A confused writer's other members name no
    key, and a registry key of another type (a stray SET: WRONGTYPE) lists nothing; any other
    error (a refused permission) is raised."""
    if isinstance(members, ResponseError) and "WRONGTYPE" in str(members):
        return ()
    if isinstance(members, BaseException):
        raise members
    if not isinstance(members, list):
        return ()
    named = (
        member.decode(errors="replace") if isinstance(member, bytes) else str(member)
        for member in members
    )
    return tuple(dict.fromkeys(name for name in named if is_valid_id(name)))
