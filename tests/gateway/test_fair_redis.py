"""Redis as a bounded, fair resource: one key's flood of reads neither exhausts the gateway's
Redis connections (no 503) nor escapes its quota (reads count like requests), another key is
served meanwhile, ``/health`` stays 200, no slot leaks; a client resuming its own running
stream needs no second slot; a lease whose release Redis refused is given back on a retry; a
key that ignores Retry-After is refused without Redis, and waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import redis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from mlx_redis_gateway.api_keys import ApiKey
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.quotas import Quotas
from mlx_redis_protocol.keys import Keys
from mlx_redis_worker.local_redis import RedisServer
from tests.gateway.conftest import Fleet
from tests.gateway.test_auth import add_key, ask, client, key_name, open_stream, refused
from tests.support.gateway import GatewayFactory
from tests.support.sse import RawRequest
from tests.support.waiting import wait_until

FLOOD = 400  # concurrent reads, more than the gateway's 256 Redis command slots


def test_a_read_flood_of_one_key_leaves_another_served_and_leaks_nothing(
    fleet: Fleet, gateways: GatewayFactory, admin: redis.Redis, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    flood_name, victim_name = key_name("flood"), key_name("victim")
    flooder = add_key(keys, flood_name, "--requests-per-minute", "30", "--max-concurrent", "4")
    victim = add_key(keys, victim_name, "--max-concurrent", "4")
    # Every read comes from 127.0.0.1, as /health's: the bound under test is Redis command
    # slots, not the per-address connection cap (tests/gateway/test_connection_caps.py).
    gateway = gateways.start(
        "--api-keys", str(keys), "--max-connections-per-address", str(2 * FLOOD)
    )
    statuses: Counter[int] = Counter()
    healths: list[int] = []

    async def flood() -> None:
        async def read() -> int:
            return await get(
                gateway.port, f"/v1/requests/chatcmpl-{uuid.uuid4().hex}", f"Bearer {flooder}"
            )

        async def health() -> None:
            for _ in range(5):
                healths.append(await get(gateway.port, "/health"))
                await asyncio.sleep(0.2)

        reads = asyncio.gather(*(read() for _ in range(FLOOD)))
        _, answers = await asyncio.gather(health(), reads)
        statuses.update(answers)

    flooding = threading.Thread(target=lambda: asyncio.run(flood()))
    flooding.start()
    try:
        victims = [ask(client(gateway, victim)) for _ in range(4)]
    finally:
        flooding.join(300)
    assert not flooding.is_alive()
    assert all(answer.choices[0].finish_reason == "length" for answer in victims)
    # Reads count against the key: 30 a minute, then 429; never a 503 for want of Redis.
    assert statuses[503] == 0, statuses
    assert set(statuses) <= {404, 429} and statuses[404] <= 30, statuses
    assert healths == [200] * 5
    # Every read's lease went back: the flooding key's and the victim's slots are all free.
    leases = Keys(fleet.prefix)
    for name in (flood_name, victim_name):
        wait_until(
            lambda name=name: admin.zcard(leases.quota_in_flight(name)) == 0,  # type: ignore[misc]
            10,
            lambda name=name: f"{name}'s leases to be given back",  # type: ignore[misc]
        )
    with contextlib.ExitStack() as streams:
        for _ in range(4):
            open_stream(client(gateway, victim), streams)
    with urllib.request.urlopen(gateway.url + "/health", timeout=10) as answer:
        health = json.load(answer)
    assert health["status"] == "ok" and health["redis"]["saturated"] is False


async def get(port: int, path: str, authorization: str | None = None) -> int:
    """One GET on a connection of its own; the answer's status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        auth = f"Authorization: {authorization}\r\n" if authorization else ""
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n".encode()
        )
        status = await reader.readline()
        await reader.read()
        return int(status.split(b" ")[1])
    finally:
        writer.close()


def test_resuming_ones_own_running_stream_needs_no_second_slot(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name("single"), "--max-concurrent", "1")
    gateway = gateways.start("--api-keys", str(keys))
    single = client(gateway, secret)
    with contextlib.ExitStack() as streams:
        first = next(open_stream(single, streams))
        with RawRequest(
            gateway.url,
            "GET",
            f"/v1/requests/{first.id}/stream",
            headers={"Authorization": f"Bearer {secret}", "Last-Event-ID": "1"},
        ) as again:
            assert again.response().status == 200
            assert next(again.messages()).id is not None
        # A new request still finds the key's one slot taken by the running stream.
        error = refused(lambda: ask(single), openai.RateLimitError)
        assert error.code == "concurrency_limit_exceeded"


def test_a_lease_whose_release_redis_refused_is_given_back_on_a_retry(
    redis_server: RedisServer, prefix: str
) -> None:
    async def scenario() -> int:
        refusing = False
        connection = Redis.from_url(redis_server.url)

        @contextlib.asynccontextmanager
        async def slot() -> AsyncIterator[Redis]:
            if refusing:
                raise RedisConnectionError("Too many connections")
            yield connection

        keys = Keys(prefix)
        quotas = Quotas(slot, keys, lease_seconds=30)
        key = ApiKey(name="k", sha256="0" * 64, requests_per_minute=None, max_concurrent=2)
        try:
            assert await quotas.admit(key, "chatcmpl-" + "1" * 32) is None
            refusing = True
            await quotas.release("chatcmpl-" + "1" * 32)  # refused: retried in the background
            refusing = False
            for _ in range(100):
                if await connection.zcard(keys.quota_in_flight("k")) == 0:
                    break
                await asyncio.sleep(0.05)
            return int(await connection.zcard(keys.quota_in_flight("k")))
        finally:
            await quotas.close()
            await connection.aclose()

    assert asyncio.run(scenario()) == 0


def test_a_key_that_ignores_retry_after_costs_redis_nothing_and_waits_it_out(
    redis_server: RedisServer, prefix: str
) -> None:
    """Past a key's first refusal for its rate, this gateway refuses it alone until its next
    token is due, holding a request that came back early (at most 3 s) before its 429;
    a key at its cap in this gateway's own leases is refused without Redis too. What only
    Redis knows (a read's holder, a changed rate) is still asked of it."""

    async def scenario() -> None:
        connection = Redis.from_url(redis_server.url)
        commands = 0

        @contextlib.asynccontextmanager
        async def slot() -> AsyncIterator[Redis]:
            nonlocal commands
            commands += 1
            yield connection

        quotas = Quotas(slot, Keys(prefix), lease_seconds=30)
        rated = ApiKey(name="rated", sha256="0" * 64, requests_per_minute=1, max_concurrent=None)
        capped = ApiKey(name="capped", sha256="1" * 64, requests_per_minute=None, max_concurrent=2)
        try:
            assert await quotas.admit(rated, "r-1") is None
            first = await quotas.admit(rated, "r-2")
            assert first is not None and first.reason == "rate" and not first.early
            assert commands == 2
            started = asyncio.get_running_loop().time()
            with pytest.raises(ApiError) as early:
                await quotas.admit_or_refuse(rated, "r-3")
            held = asyncio.get_running_loop().time() - started
            assert early.value.status == 429 and early.value.code == "rate_limit_exceeded"
            assert 2.9 <= held < 5 and early.value.retry_after is not None
            assert 50 < early.value.retry_after < first.retry_after
            assert commands == 2  # nothing asked of Redis
            raised = replace(rated, requests_per_minute=1000)  # the key file changed
            assert await quotas.admit(raised, "r-4") is None and commands == 3

            assert await quotas.admit(capped, "c-1") is None
            assert await quotas.admit(capped, "c-2") is None
            at_cap = await quotas.admit(capped, "c-3")
            assert at_cap is not None and at_cap.reason == "concurrency" and at_cap.early
            assert commands == 5
            read = await quotas.admit(capped, "c-1/read-1", holder="c-1")
            assert read is None and commands == 6  # the holder's lease spares it a slot
            await quotas.release("c-1/read-1")
            await quotas.release("c-1")
            assert await quotas.admit(capped, "c-4") is None
        finally:
            await quotas.close()
            await connection.aclose()

    asyncio.run(scenario())
