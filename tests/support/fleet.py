"""Heartbeats written by hand, as a worker writes them: the heartbeat key, then the worker's
member in the fleet's registry (readers find live workers through it, never by SCAN)."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.registry import register_worker


async def write_heartbeat(
    client: RedisClient,
    keys: Keys,
    worker_id: str,
    value: bytes | str,
    models: Sequence[str] = (),
    ttl_ms: int = 60_000,
) -> None:
    """A worker's heartbeat ``value`` (any bytes: a reader must cope) and its registration."""
    await client.set(keys.worker(worker_id), value, px=ttl_ms)
    await register_worker(client, keys, worker_id, ttl_ms, models)


def write_heartbeat_sync(
    client: redis.Redis, keys: Keys, worker_id: str, value: bytes | str, ttl_ms: int = 60_000
) -> None:
    """The same with a blocking client, registering as the spec tells a worker without the
    script: ``ZADD`` with the expiry in ms of Redis' clock."""
    seconds, micros = client.time()
    client.set(keys.worker(worker_id), value, px=ttl_ms)
    client.zadd(keys.workers, {worker_id: seconds * 1000 + micros // 1000 + ttl_ms})
