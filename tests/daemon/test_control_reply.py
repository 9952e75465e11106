"""A control reply that meets Redis down is not lost: the worker answers once Redis is back.
A broadcast's replies cost one command each: only the reply that makes the list sets its TTL."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_protocol.channels import ChannelHub
from mlx_redis_protocol.codec_control import decode_reply, encode_command
from mlx_redis_protocol.connection import connect
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import ControlCommand
from mlx_redis_worker.daemon.control import ControlListener
from mlx_redis_worker.local_redis import RedisServer


async def _nothing(*_: Any) -> dict[str, Any]:
    return {}


@pytest.mark.timeout(60)
def test_a_reply_meeting_redis_down_is_pushed_once_redis_is_back(tmp_path: Path) -> None:
    """The worker got a command, and Redis went away before its reply (the seconds of a
    failover: the Cluster failover profile's stats reply was lost this way, one run in three
    under load). The reply is tried again until Redis answers, and reaches the sender's list
    exactly once."""
    server = RedisServer(directory=tmp_path / "redis")
    server.start()
    keys = Keys(prefix="reply-test")
    token = uuid.uuid4().hex
    command = ControlCommand(kind="ping", id=token, reply_to=keys.reply(token))

    async def scenario() -> list[bytes]:
        redis = await connect(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        listener = _listener(redis, keys, "w1", tmp_path)
        try:
            await asyncio.to_thread(server.stop)
            answering = asyncio.create_task(listener.handle(encode_command(command)))
            await asyncio.sleep(1.5)
            assert not answering.done(), "the reply must wait for Redis, not give up"
            await asyncio.to_thread(server.start)
            await asyncio.wait_for(answering, 20)
            replies: list[bytes] = await redis.lrange(command.reply_to, 0, -1)
            return replies
        finally:
            await redis.aclose()

    try:
        replies = asyncio.run(scenario())
    finally:
        server.close()
    assert len(replies) == 1
    reply = decode_reply(replies[0])
    assert reply.ok and reply.worker_id == "w1" and reply.id == token
    assert reply.result["pong"] is True


def _listener(redis: Any, keys: Keys, worker_id: str, tmp_path: Path) -> ControlListener:
    return ControlListener(
        redis=redis,
        hub=ChannelHub(redis),
        keys=keys,
        worker_id=worker_id,
        engines={},
        cache_dir=tmp_path / "caches",
        reply_ttl=60,
        limits=DEFAULT_LIMITS,
        abort_job=_nothing,
        stats=_nothing,
    )


@pytest.mark.timeout(60)
def test_a_broadcast_reply_is_one_rpush_and_only_the_list_maker_sets_its_ttl(
    tmp_path: Path,
) -> None:
    """Twenty workers answer one broadcast: twenty RPUSHes, one EXPIRE (before: one each),
    and the list has its TTL. The sender takes them all, which deletes the list; a late
    reply makes it again, and gives it a TTL again: no reply list outlives its TTL."""
    server = RedisServer(directory=tmp_path / "redis")
    server.start()
    keys = Keys(prefix="reply-ttl")
    token = uuid.uuid4().hex
    command = encode_command(ControlCommand(kind="ping", id=token, reply_to=keys.reply(token)))

    async def scenario() -> tuple[dict[str, int], int, dict[str, int], int]:
        redis = await connect(server.url)
        try:
            listeners = [_listener(redis, keys, f"w{i}", tmp_path) for i in range(21)]
            before = await _calls(redis)
            for listener in listeners[:20]:
                await listener.handle(command)
            first = _delta(before, await _calls(redis))
            ttl = int(await redis.ttl(keys.reply(token)))
            assert len(await redis.lpop(keys.reply(token), 100)) == 20  # the list is gone
            before = await _calls(redis)
            await listeners[20].handle(command)
            late = _delta(before, await _calls(redis))
            return first, ttl, late, int(await redis.ttl(keys.reply(token)))
        finally:
            await redis.aclose()

    try:
        first, ttl, late, late_ttl = asyncio.run(scenario())
    finally:
        server.close()
    assert first == {"rpush": 20, "expire": 1}
    assert 0 < ttl <= 60
    assert late == {"rpush": 1, "expire": 1}
    assert 0 < late_ttl <= 60


async def _calls(redis: Any) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {
        name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("rpush", "expire")
    }


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after}
