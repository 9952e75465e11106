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

Readers take at most ``MAX_REGISTRY_READ`` members of each, the newest first: a registry that
a confused writer filled cannot make a read unbounded, and live workers (the latest expiries)
come before dead ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

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

# KEYS: workers, models. ARGV: worker id, heartbeat TTL in ms, grace in ms, served models...
# Redis' own clock, so every worker's expiries compare on one clock. ZADD before the prune:
# a full Redis (noeviction) refuses the ZADD, and then nobody's member is dropped either.
REGISTER_WORKER: Final = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
for i = 4, #ARGV do
  redis.call('ZADD', KEYS[2], now, ARGV[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[3])))
return now
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


async def register_worker(
    redis: RedisClient, keys: Keys, worker_id: str, ttl_ms: int, models: Sequence[str]
) -> None:
    """Register the worker (until ``ttl_ms`` from now) and the models it serves; drop the
    members of workers that died."""
    await run_script(
        redis,
        REGISTER_WORKER,
        [keys.workers, keys.models],
        [worker_id, ttl_ms, PRUNE_GRACE_MS, *models],
    )


async def unregister_worker(redis: RedisClient, keys: Keys, worker_id: str) -> None:
    """Take a stopping worker out of the registry (its heartbeat key goes with it)."""
    await redis.zrem(keys.workers, worker_id)


async def register_model(redis: RedisClient, keys: Keys, model: str) -> None:
    """List ``model`` in the catalogue (a producer queueing for it without a check)."""
    await run_script(redis, REGISTER_MODEL, [keys.models], [model])


async def read_registry(redis: RedisClient, keys: Keys) -> Registered:
    """The registered workers and models: one round trip (both are in one slot)."""
    async with redis.pipeline(transaction=False) as pipe:
        # ZRANGE … REV (Redis >= 6.2), not redis-py's desc=True, which sends ZREVRANGE: one
        # command for an ACL to grant.
        for registry in (keys.workers, keys.models):
            pipe.execute_command("ZRANGE", registry, 0, MAX_REGISTRY_READ - 1, "REV")
        workers, models = await pipe.execute(raise_on_error=False)
    return Registered(workers=_ids(workers), models=_ids(models))


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
