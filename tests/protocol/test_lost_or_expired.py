"""A subscriber tells a request whose log Redis lost from one whose log expired, on a real
redis-server: restarted empty under a follower (RequestLost), a finished request whose log
expired (RequestExpired at once), an id nobody queued (the plain RequestNotFound). A log TTL
running out under a follower (RequestExpired) is in test_stream_merge.py. Before, every case
read "its log expired"."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.errors import RequestExpired, RequestLost, RequestNotFound
from mlx_redis_protocol.messages import Event, QueuedEvent
from mlx_redis_worker.local_redis import RedisServer
from tests.support.waiting import run

RECHECK = 0.2  # the follower's idle re-read of the log


async def follow(client: Client, request_id: str, seen: list[Event]) -> None:
    async with aclosing(client.stream(request_id, timeout=30)) as events:
        async for event in events:
            seen.append(event)


@pytest.mark.timeout(60)
def test_a_redis_restarted_empty_under_a_follower_is_lost_data_not_an_expired_log(
    prefix: str,
) -> None:
    with RedisServer() as server:  # no persistence: a restart comes back empty

        async def main() -> None:
            async with Client(server.url, prefix=prefix, recheck_interval=RECHECK) as client:
                rid = await client.submit("waits: no worker runs it", max_tokens=4)
                seen: list[Event] = []
                following = asyncio.create_task(follow(client, rid, seen))
                while not seen:  # the queued marker came from the log
                    await asyncio.sleep(0.02)
                assert isinstance(seen[0], QueuedEvent)
                await asyncio.to_thread(server.restart)
                started = time.monotonic()
                with pytest.raises(RequestLost) as raised:
                    await following
                assert time.monotonic() - started < 10
                message = str(raised.value)
                assert "Redis lost the data" in message and "before its TTL ran out" in message
                assert "expired" not in message

        run(main())


def test_a_missing_log_says_expired_only_for_a_request_that_finished(
    redis_url: str, prefix: str
) -> None:
    async def main() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            # A finished request whose log expired: its finished marker outlives the log.
            await client.redis.set(client.keys.finished("ended"), b"1", ex=60)
            with pytest.raises(RequestExpired, match="it finished, and its log expired"):
                await follow(client, "ended", [])
            with pytest.raises(RequestNotFound) as raised:
                await follow(client, "never-queued", [])
            assert type(raised.value) is RequestNotFound
            assert "never queued, its log expired, or Redis lost it" in str(raised.value)

    run(main())
