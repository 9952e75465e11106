"""One worker (the tiny model) per test module, a gateway and an openai client per module in
front of it (or gateways started per test), and the protocol's own answers to compare with."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, Event, TerminalEvent
from mlx_redis_worker.local_redis import RedisServer
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.processes import MODEL, WorkerFactory, WorkerProcess


@dataclass
class Fleet:
    redis_url: str
    prefix: str
    worker: WorkerProcess

    def generate(self, model: str = "tiny", **job: Any) -> DoneEvent:
        """A request's end, queued and followed through the protocol's own client."""

        async def generate() -> TerminalEvent:
            async with Client(self.redis_url, prefix=self.prefix) as client:
                return await client.generate(model=model, timeout=60, **job)

        end = asyncio.run(generate())
        assert isinstance(end, DoneEvent), end
        return end

    def logged_events(self, request_id: str) -> list[Event]:
        """A finished request's events, read back from its replay log (to its end)."""

        async def read() -> list[Event]:
            async with Client(self.redis_url, prefix=self.prefix) as client:
                events = []
                async for event in client.stream(request_id, timeout=30):
                    events.append(event)
                    if isinstance(event, TerminalEvent):
                        break
                return events

        return asyncio.run(read())

    def logged_done(self, request_id: str) -> DoneEvent:
        """A finished request's ``done`` event, from its replay log."""
        end = self.logged_events(request_id)[-1]
        assert isinstance(end, DoneEvent), end
        return end


@contextlib.contextmanager
def running_fleet(
    redis_server: RedisServer, directory: Path, model: str = MODEL, max_concurrency: int = 8
) -> Iterator[Fleet]:
    """A worker serving ``model`` (``mlx-worker run --model``) under a prefix of its own,
    killed (and its log printed) at the end."""
    prefix = f"g{uuid.uuid4().hex[:12]}"
    factory = WorkerFactory(directory, redis_server.url, prefix)
    try:
        worker = factory.start("gw-worker", model=model, max_concurrency=max_concurrency)
        yield Fleet(redis_server.url, prefix, worker)
    finally:
        factory.kill_all()
        print(factory.report())


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A worker serving ``tiny`` (8 slots) under a prefix of this module's own."""
    with running_fleet(redis_server, tmp_path_factory.mktemp("fleet")) as fleet:
        yield fleet


@pytest.fixture
def lone_gateways(redis_server: RedisServer, tmp_path: Path) -> Iterator[GatewayFactory]:
    """Gateways with no worker behind them (a prefix of the test's own), for what happens
    before a job exists; stopped (and their logs printed) at the test's end."""
    factory = GatewayFactory(tmp_path, redis_server.url, f"h{uuid.uuid4().hex[:12]}")
    try:
        yield factory
    finally:
        factory.stop_all()
        print(factory.report())


@pytest.fixture
def gateways(fleet: Fleet, tmp_path: Path) -> Iterator[GatewayFactory]:
    """Start ``mlx-worker gateway`` processes in front of the module's worker; stopped (and
    their logs printed) at the test's end."""
    factory = GatewayFactory(tmp_path, fleet.redis_url, fleet.prefix)
    try:
        yield factory
    finally:
        factory.stop_all()
        print(factory.report())


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One gateway in front of the module's fleet, for tests that change nothing in it."""
    factory = GatewayFactory(tmp_path_factory.mktemp("gateway"), fleet.redis_url, fleet.prefix)
    try:
        yield factory.start()
    finally:
        factory.stop_all()
        print(factory.report())


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    """OpenAI's own client of the module's gateway (no retries: a failure shows at once)."""
    with openai.OpenAI(
        base_url=gateway.base_url, api_key="none", max_retries=0, timeout=300
    ) as client:
        yield client
