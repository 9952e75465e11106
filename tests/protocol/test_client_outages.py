"""The client while Redis stalls or goes away: streams ride out what their timeout allows, and
every failure reaches the caller as a documented exception (and the CLI as its exit code)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import aclosing

import pytest
from redis.asyncio import Redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.errors import RedisUnavailable, StreamTimeout
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import Event
from mlx_redis_worker.local_redis import RedisServer
from tests.protocol.helpers import delta, done, emit
from tests.support.waiting import run


@pytest.fixture
def debuggable_redis() -> Iterator[RedisServer]:
    """A private server that allows DEBUG SLEEP (it stalls every client of the server)."""
    with RedisServer(extra_args=("--enable-debug-command", "yes")) as server:
        yield server


def test_a_stream_rides_out_a_stall_longer_than_the_socket_timeout(
    debuggable_redis: RedisServer, keys: Keys
) -> None:
    """Redis stops answering for 2.5 s, the client's socket timeout is 1 s and its stream
    re-reads the log every 0.3 s, so its reads time out during the stall: the stream still
    yields every event once, in order, and ends normally (its own timeout is 10 s)."""
    url = debuggable_redis.url

    async def worker(request_id: str) -> None:
        redis = Redis.from_url(url, socket_timeout=10)
        try:
            for seq in range(1, 6):
                await emit(redis, keys, delta(request_id, seq, f"<{seq}>"))
                await asyncio.sleep(0.1)
            await redis.execute_command("DEBUG", "SLEEP", "2.5")
            for seq in range(6, 11):
                await emit(redis, keys, delta(request_id, seq, f"<{seq}>"))
            await emit(redis, keys, done(request_id, 11, "".join(f"<{i}>" for i in range(1, 11))))
        finally:
            await redis.aclose()

    async def scenario() -> tuple[list[Event], float]:
        async with Client(
            url, prefix=keys.prefix, socket_timeout=1.0, recheck_interval=0.3
        ) as client:
            request_id = await client.submit("hi", request_id="stalled")
            started = time.monotonic()
            async with aclosing(client.stream(request_id, timeout=10)) as stream:
                publishing = asyncio.create_task(worker(request_id))
                events = [event async for event in stream]
            await publishing
            return events, time.monotonic() - started

    events, seconds = run(scenario())
    assert [event.seq for event in events] == list(range(12))
    assert events[-1].terminal
    assert seconds >= 2.5  # the stall happened while the stream was open


def test_redis_gone_for_good_ends_streams_and_submits_with_documented_errors(
    keys: Keys,
) -> None:
    """With Redis stopped: a stream whose timeout is shorter than the client's
    ``unavailable_timeout`` ends with StreamTimeout, one without a timeout with
    RedisUnavailable; ``submit`` says the job was not queued. Nothing hangs."""
    server = RedisServer()
    server.start()

    async def scenario() -> tuple[str, str, str, float]:
        async with Client(
            server.url, prefix=keys.prefix, unavailable_timeout=1.5, recheck_interval=0.2
        ) as client:
            request_id = await client.submit("hi", request_id="orphan")
            server.stop()
            started = time.monotonic()
            with pytest.raises(StreamTimeout) as short:
                async with aclosing(client.stream(request_id, timeout=0.5)) as stream:
                    [event async for event in stream]
            with pytest.raises(RedisUnavailable) as unbounded:
                async with aclosing(client.stream(request_id)) as stream:
                    [event async for event in stream]
            with pytest.raises(RedisUnavailable) as submitting:
                await client.submit("again")
            return (
                str(short.value),
                str(unbounded.value),
                str(submitting.value),
                (time.monotonic() - started),
            )

    try:
        short, unbounded, submitting, seconds = run(scenario())
    finally:
        server.close()
    assert "no event for 0.5 s (Redis unreachable" in short
    assert "Redis unreachable for 1.5 s while following 'orphan'" in unbounded
    assert "was not queued" in submitting
    assert seconds < 10


def test_the_cli_reports_an_unreachable_redis_in_one_line_with_exit_2() -> None:
    server = RedisServer()  # a free port nobody listens on: the server is never started
    completed = subprocess.run(
        [sys.executable, "-m", "mlx_redis_protocol.cli", "stream", "r1", "--redis-url", server.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    server.close()
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, completed.stderr
    assert lines[0].startswith(f"mlx-worker: cannot connect to Redis at {server.url}")
