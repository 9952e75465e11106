"""The fleet's registry (protocol/mlx_redis_protocol/registry.py) on a real redis-server: what a
registration writes, which members it prunes, and what readers make of members a confused
writer left (not ids, a registry key of another type, a member whose worker died)."""

from __future__ import annotations

import asyncio

from mlx_redis_protocol.catalogue import live_worker_ids, served_models
from mlx_redis_protocol.connection import RedisClient, connect
from mlx_redis_protocol.control import count_live_workers
from mlx_redis_protocol.heartbeat import (
    MAX_HEARTBEAT_BYTES,
    MAX_MODELS_PER_WORKER,
    decode_heartbeat,
)
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.registry import (
    MAX_REGISTRY_READ,
    PRUNE_GRACE_MS,
    read_registry,
    register_model,
    register_worker,
    unregister_worker,
)
from tests.protocol.test_client_models import heartbeat
from tests.support.fleet import write_heartbeat
from tests.support.waiting import run


async def redis_now_ms(redis: RedisClient) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_registration_scores_by_expiry_and_prunes_members_dead_past_the_grace(
    redis_url: str, keys: Keys
) -> None:
    async def main() -> None:
        redis = await connect(redis_url)
        try:
            now = await redis_now_ms(redis)
            await redis.zadd(
                keys.workers,
                {"long-dead": now - PRUNE_GRACE_MS - 1000, "just-expired": now - 1000},
            )
            await register_worker(redis, keys, "w1", 15_000, ["a", "b"])
            scores = dict(await redis.zrange(keys.workers, 0, -1, withscores=True))
            assert set(scores) == {b"just-expired", b"w1"}  # within the grace: kept
            assert now + 14_000 <= scores[b"w1"] <= now + 20_000
            registered = await read_registry(redis, keys)
            assert registered.workers == ("w1", "just-expired")  # newest expiry first
            assert sorted(registered.models) == ["a", "b"]
            # A producer's unchecked model is added; an advertised one keeps its time.
            advertised = await redis.zscore(keys.models, "a")
            await register_model(redis, keys, "a")
            await register_model(redis, keys, "c")
            assert await redis.zscore(keys.models, "a") == advertised
            assert "c" in (await read_registry(redis, keys)).models
            await unregister_worker(redis, keys, "w1")
            assert (await read_registry(redis, keys)).workers == ("just-expired",)
        finally:
            await redis.aclose()

    run(main())


def test_readers_trust_the_heartbeat_key_not_the_member(redis_url: str, keys: Keys) -> None:
    """A member whose heartbeat key is gone (the worker died, its member not yet pruned) is no
    live worker; members that are not ids are skipped; the catalogue reads only what is
    registered."""

    async def main() -> None:
        redis = await connect(redis_url)
        try:
            await write_heartbeat(redis, keys, "alive", heartbeat("alive", "a").encode(), ["a"])
            await register_worker(redis, keys, "dead", 15_000, ["z"])
            now = await redis_now_ms(redis)
            await redis.zadd(keys.workers, {"not an id": now + 60_000, "{x}": now + 60_000})
            # A heartbeat nobody registered is not found: readers never scan for keys.
            await redis.set(keys.worker("unregistered"), heartbeat("u", "u").encode(), ex=60)
            assert await live_worker_ids(redis, keys) == ["alive"]
            assert await count_live_workers(redis, keys) == 1
            assert await served_models(redis, keys) == {"a"}
        finally:
            await redis.aclose()

    run(main())


def test_a_registry_key_of_another_type_is_replaced_by_the_next_registration(
    redis_url: str, keys: Keys
) -> None:
    """A stray SET (or a stream) on a registry key: readers see nothing there (and say so),
    a reader that may wait gets the answer of the next heartbeat, which replaces the key."""

    async def main() -> None:
        redis = await connect(redis_url)
        try:
            await redis.set(keys.workers, b"stray")
            await redis.xadd(keys.models, {"x": b"1"})
            registered = await read_registry(redis, keys, repair_wait=0)
            assert (registered.workers, registered.models) == ((), ())
            assert registered.unreadable == (keys.workers, keys.models)
            waiting = asyncio.ensure_future(read_registry(redis, keys, repair_wait=30))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            await redis.set(keys.worker("alive"), heartbeat("alive", "a").encode(), px=60_000)
            registration = await register_worker(redis, keys, "alive", 60_000, ["a"])
            assert registration.replaced == [keys.workers, keys.models]
            assert registration.workers == 1
            registered = await waiting
            assert (registered.workers, registered.models, registered.unreadable) == (
                ("alive",),
                ("a",),
                (),
            )
            assert await served_models(redis, keys) == {"a"}
            again = await register_worker(redis, keys, "alive", 60_000, ["a"])
            assert (again.replaced, again.workers) == ([], 1)
        finally:
            await redis.aclose()

    run(main())


def test_members_that_never_expire_neither_hide_workers_nor_stay(
    redis_url: str, keys: Keys
) -> None:
    """4,096 members scored +inf (and as many models) would fill every read of the newest
    members: readers skip scores no heartbeat can have, and a registration drops them."""

    async def main() -> None:
        redis = await connect(redis_url)
        try:
            fake = {f"fake-{i}": float("inf") for i in range(MAX_REGISTRY_READ)}
            await redis.zadd(keys.workers, fake)
            await redis.zadd(keys.models, {f"m-{i}": float("inf") for i in range(4096)})
            await redis.set(keys.worker("alive"), heartbeat("alive", "a").encode(), px=60_000)
            await redis.zadd(keys.workers, {"alive": await redis_now_ms(redis) + 60_000})
            await redis.zadd(keys.models, {"a": await redis_now_ms(redis)})
            assert await live_worker_ids(redis, keys) == ["alive"]
            assert (await read_registry(redis, keys)).models == ("a",)
            registration = await register_worker(redis, keys, "other", 15_000, ["b"])
            assert registration.workers == await redis.zcard(keys.workers) == 2
            assert sorted(await redis.zrange(keys.models, 0, -1)) == [b"a", b"b"]
        finally:
            await redis.aclose()

    run(main())


def test_a_heartbeat_claiming_twenty_thousand_models_is_bounded() -> None:
    huge = heartbeat("big", *(f"model-{i}" for i in range(20_000))).encode()
    assert len(huge) > MAX_HEARTBEAT_BYTES
    assert decode_heartbeat(huge) is None
    many = heartbeat("many", *(f"m{i}" for i in range(200))).encode()
    decoded = decode_heartbeat(many)
    assert decoded is not None and len(decoded.models) == MAX_MODELS_PER_WORKER
