"""The response store's scripts on a real 3-master Redis Cluster: a key's index, total and
records share its slot, so storing past the bound drops the oldest record's key (which the
script builds from its id) on the node that holds them, and deleting keeps the total."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mlx_redis_gateway.response_store import (
    PRUNE_BATCH,
    ResponseStore,
    StoredResponse,
    StoreLimits,
)
from mlx_redis_protocol.connection import RedisClient, connect
from mlx_redis_protocol.keys import Keys
from mlx_redis_worker.local_redis import LocalCluster
from tests.support.waiting import run


def stored(response_id: str, text: str) -> StoredResponse:
    response: dict[str, Any] = {"id": response_id, "object": "response", "output": []}
    items = [{"id": f"msg_{response_id}", "type": "message", "role": "user", "content": text}]
    return StoredResponse(response, [], items)


def test_a_keys_records_are_stored_dropped_and_deleted_in_its_slot_on_a_cluster(
    redis_cluster: LocalCluster, prefix: str
) -> None:
    keys = Keys(prefix)
    size = len(stored("resp_0", "x" * 1000).encode())
    # Room for two records of a key, not three.
    limits = StoreLimits(ttl_seconds=600, max_response_bytes=size, max_key_bytes=2 * size + 10)

    async def main() -> None:
        redis = await connect(redis_cluster.url, topology="cluster")

        @asynccontextmanager
        async def slot() -> AsyncIterator[RedisClient]:
            yield redis

        store = ResponseStore(slot, keys, limits)
        try:
            for scope in ("alice", "bob"):
                for n in range(3):
                    assert await store.save(scope, stored(f"resp_{n}", "x" * 1000))
            for scope in ("alice", "bob"):
                assert await store.load(scope, "resp_0") is None  # the oldest, dropped
                assert not await redis.exists(keys.stored_response(scope, "resp_0"))
                kept = await store.load(scope, "resp_2")
                assert kept is not None and kept.input_items[0]["content"] == "x" * 1000
                total = int(await redis.get(keys.stored_responses_bytes(scope)) or 0)
                assert total == 2 * size
            assert await store.delete("alice", "resp_1")
            assert not await store.delete("alice", "resp_1")
            assert not await store.delete("bob", "resp_0")
            assert int(await redis.get(keys.stored_responses_bytes("alice")) or 0) == size
            assert await redis.zcard(keys.stored_responses("alice")) == 1
            # A record over the bound of one response is not kept.
            assert not await store.save("alice", stored("resp_9", "x" * 2000))
            assert await store.load("alice", "resp_9") is None
        finally:
            await redis.aclose()

    run(main())


def test_a_record_without_item_ids_is_no_record() -> None:
    """Records are JSON anyone with write access could have written: one whose items lack
    the ids ``input_items`` pages by reads as missing, not as a 500 later."""
    good = stored("resp_1", "hi")
    assert StoredResponse.decode(good.encode()) == good
    for bad in (
        b'{"response": {"id": "resp_1", "output": []}, "context": [], "input": [{}]}',
        b'{"response": {"id": "resp_1", "output": [{"id": 3}]}, "context": [], "input": []}',
        b'{"response": {"output": []}, "context": [], "input": []}',
        b"[]",
        b"\xff",
    ):
        assert StoredResponse.decode(bad) is None, bad


def test_expired_entries_are_forgotten_a_batch_a_store(redis_url: str, prefix: str) -> None:
    """Entries whose time is past (here written so) leave the index and the total at the
    next stores, at most ``PRUNE_BATCH`` a store."""
    keys = Keys(prefix)
    limits = StoreLimits(ttl_seconds=600)

    async def main() -> None:
        redis = await connect(redis_url)

        @asynccontextmanager
        async def slot() -> AsyncIterator[RedisClient]:
            yield redis

        store = ResponseStore(slot, keys, limits)
        index, total = keys.stored_responses("carol"), keys.stored_responses_bytes("carol")
        expired = {f"10/resp_old{n}": n + 1 for n in range(PRUNE_BATCH + 1)}
        try:
            await redis.zadd(index, expired)
            await redis.set(total, 10 * len(expired))
            first, second = stored("resp_a", "a"), stored("resp_b", "b")
            assert await store.save("carol", first)
            assert await redis.zcard(index) == 2  # one expired entry left, and the new one
            assert int(await redis.get(total) or 0) == 10 + len(first.encode())
            assert await store.save("carol", second)
            assert sorted(await redis.zrange(index, 0, -1)) == sorted(
                f"{len(each.encode())}/{each.response['id']}".encode() for each in (first, second)
            )
            assert int(await redis.get(total) or 0) == len(first.encode()) + len(second.encode())
        finally:
            await redis.aclose()

    run(main())
