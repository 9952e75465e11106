"""Control commands round trip through Redis with stand-in workers."""

from __future__ import annotations

import time

import pytest
import redis
from redis.asyncio import Redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_control import encode_reply
from mlx_redis_protocol.connection import connect
from mlx_redis_protocol.control import ControlReplies, _collect, longest_block
from mlx_redis_protocol.errors import ControlTimeout
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import ControlCommand, ControlReply
from tests.protocol.fake_responder import FakeResponder
from tests.support.acl import PASSWORD, MakeUser
from tests.support.fleet import write_heartbeat
from tests.support.waiting import run


def test_ping_and_stats_broadcast_collect_every_live_worker(redis_url: str, prefix: str) -> None:
    async def scenario() -> tuple[list[ControlReply], list[ControlReply], float]:
        async with Client(redis_url, prefix=prefix) as client:
            redis, keys = client.redis, client.keys
            async with FakeResponder(redis, keys, "w-1"), FakeResponder(redis, keys, "w-2"):
                started = time.monotonic()
                pings = await client.ping(timeout=5)
                elapsed = time.monotonic() - started
                stats = await client.stats(timeout=5)
            return pings, stats, elapsed

    pings, stats, elapsed = run(scenario())
    assert sorted(reply.worker_id for reply in pings) == ["w-1", "w-2"]
    assert all(reply.ok for reply in pings + stats)
    assert elapsed < 2  # returned once both answered, not at the timeout
    assert {reply.result["worker"] for reply in stats if reply.result} == {"w-1", "w-2"}


def test_command_to_one_worker(redis_url: str, prefix: str) -> None:
    async def scenario() -> tuple[list[ControlReply], list[str]]:
        async with Client(redis_url, prefix=prefix) as client:
            redis, keys = client.redis, client.keys
            async with (
                FakeResponder(redis, keys, "w-1") as first,
                FakeResponder(redis, keys, "w-2") as second,
            ):
                replies = await client.stats(worker_id="w-2", timeout=5)
                await client.cache_save("warm", worker_id="w-2", timeout=5)
            return replies, [c.kind for c in first.received + second.received]

    replies, kinds = run(scenario())
    assert [reply.worker_id for reply in replies] == ["w-2"]
    assert kinds == ["stats", "cache_save"]


def test_cache_commands_and_error_replies(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[ControlReply]:
        async with Client(redis_url, prefix=prefix) as client:
            async with FakeResponder(client.redis, client.keys, "w-1") as worker:
                replies = await client.cache_save("a", timeout=5)
                replies += await client.cache_load("missing", timeout=5)
                replies += await client.cache_clear(timeout=5)
                assert [(c.kind, c.name) for c in worker.received] == [
                    ("cache_save", "a"),
                    ("cache_load", "missing"),
                    ("cache_clear", None),
                ]
            return replies

    replies = run(scenario())
    assert [reply.ok for reply in replies] == [True, False, True]
    assert replies[1].error is not None and replies[1].error.code == "not_found"


def test_abort_sets_the_marker_and_tells_the_workers(redis_url: str, prefix: str) -> None:
    async def scenario() -> tuple[list[ControlReply], int, list[ControlReply]]:
        async with Client(redis_url, prefix=prefix, abort_ttl=120) as client:
            nobody = await client.abort("req-1", timeout=5)  # no worker: marker only, no wait
            ttl = await client.redis.ttl(client.keys.abort("req-1"))
            async with FakeResponder(client.redis, client.keys, "w-1") as worker:
                replies = await client.abort("req-2", timeout=5)
                assert worker.received[0].request_id == "req-2"
            return nobody, ttl, replies

    nobody, ttl, replies = run(scenario())
    assert nobody == []
    assert 110 <= ttl <= 120
    assert [reply.ok for reply in replies] == [True]


def test_timeout_when_a_live_worker_does_not_answer(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            # A heartbeat but nobody listening: the client has to wait for the timeout.
            await write_heartbeat(client.redis, client.keys, "silent", b"1", ttl_ms=30_000)
            await client.ping(timeout=0.3)

    started = time.monotonic()
    with pytest.raises(ControlTimeout):
        run(scenario())
    assert 0.3 <= time.monotonic() - started < 3


def test_timeout_at_once_when_nobody_is_there(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            await client.stats(timeout=30)

    started = time.monotonic()
    with pytest.raises(ControlTimeout):
        run(scenario())
    assert time.monotonic() - started < 3


def test_reply_lists_are_cleaned_up(redis_url: str, prefix: str) -> None:
    async def scenario() -> list[bytes]:
        async with Client(redis_url, prefix=prefix) as client:
            async with FakeResponder(client.redis, client.keys, "w-1"):
                await client.ping(timeout=5)
            return [key async for key in client.redis.scan_iter(match=f"{prefix}:reply:*")]

    assert run(scenario()) == []


def test_waits_longer_than_the_socket_timeout(redis_url: str, prefix: str) -> None:
    """A reply slower than redis-py's socket timeout still arrives (BLPOP is chunked)."""

    async def scenario() -> list[ControlReply]:
        async with (
            Client(redis_url, prefix=prefix, socket_timeout=0.5) as client,
            FakeResponder(client.redis, client.keys, "slow", delay=1.2),
        ):
            return await client.ping(timeout=3)

    assert [reply.worker_id for reply in run(scenario())] == ["slow"]


def test_blpop_blocks_stay_inside_the_socket_timeout(redis_url: str) -> None:
    async def scenario() -> list[float]:
        clients = [
            Redis.from_url(redis_url),  # redis-py's default socket timeout: 5 s
            Redis.from_url(redis_url, socket_timeout=None),
            Redis.from_url(redis_url, socket_timeout=1.0),
        ]
        blocks = [longest_block(client) for client in clients]
        for client in clients:
            await client.aclose()
        return blocks

    assert run(scenario()) == [2.5, float("inf"), 0.5]


@pytest.mark.parametrize(
    ("denied", "reads"),
    [
        ((), {"blmpop": 1}),
        (("-blmpop",), {"blmpop": 1, "blpop": 1, "lpop": 1}),  # BLMPOP refused, then 2
        (("-blmpop", "-lpop"), {"blmpop": 1, "blpop": 300, "lpop": 1}),
    ],
)
def test_replies_already_queued_are_taken_in_one_read_not_one_round_trip_each(
    redis_url: str,
    prefix: str,
    acl_user: MakeUser,
    admin: redis.Redis,
    denied: tuple[str, ...],
    reads: dict[str, int],
) -> None:
    """A broadcast to a large fleet: 300 replies waiting in the list are collected with one
    BLMPOP (before: a BLPOP and an LPOP of the rest; before that, 300 BLPOPs). A user whose
    ACL lacks BLMPOP, or LPOP too (granted before they were needed), still gets every reply:
    BLPOP then LPOP, or one BLPOP each, after one refused BLMPOP."""
    keys = Keys(prefix)
    command = ControlCommand(kind="ping", id="c-1", reply_to=keys.reply("c-1"))
    _, url = acl_user(["on", f">{PASSWORD}", f"~{prefix}:*", "+@all", *denied])
    for index in range(300):
        admin.rpush(
            command.reply_to, encode_reply(ControlReply(id="c-1", ok=True, worker_id=f"w-{index}"))
        )
    before = _list_reads(admin)

    async def scenario() -> ControlReplies:
        client = await connect(url)
        try:
            return await _collect(client, command, 300, 10.0, DEFAULT_LIMITS)
        finally:
            await client.aclose()

    replies = run(scenario())
    assert sorted(reply.worker_id for reply in replies) == sorted(f"w-{i}" for i in range(300))
    assert (replies.expected, replies.complete) == (300, True)
    after = _list_reads(admin)
    assert {name: after[name] - before[name] for name in after if after[name] > before[name]} == (
        reads
    )


def test_a_broadcast_returns_at_its_timeout_saying_how_many_of_how_many_answered(
    redis_url: str, prefix: str
) -> None:
    """Two live workers, one of them silent: the sender does not wait past its timeout for
    the slow one; it returns the one reply, and says it waited for two."""

    async def scenario() -> ControlReplies:
        async with Client(redis_url, prefix=prefix) as client:
            await write_heartbeat(client.redis, client.keys, "silent", b"1", ttl_ms=30_000)
            async with FakeResponder(client.redis, client.keys, "w-1"):
                return await client.stats(timeout=3)

    replies = run(scenario())
    assert [reply.worker_id for reply in replies] == ["w-1"]
    assert (len(replies), replies.expected, replies.complete) == (1, 2, False)


def _list_reads(admin: redis.Redis) -> dict[str, int]:
    """Calls so far of the commands that read a reply list (whether run or refused)."""
    stats = admin.info("commandstats")
    return {
        name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
        + int(stats.get(f"cmdstat_{name}", {}).get("rejected_calls", 0))
        for name in ("blmpop", "blpop", "lpop")
    }
