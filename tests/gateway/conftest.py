"""One worker (the tiny model) per test module, and gateways started per test in front of it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlx_redis_worker.local_redis import RedisServer
from tests.support.gateway import GatewayFactory
from tests.support.processes import WorkerFactory, WorkerProcess


@dataclass
class Fleet:
    redis_url: str
    prefix: str
    worker: WorkerProcess


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A worker serving ``tiny`` (8 slots) under a prefix of this module's own."""
    directory = tmp_path_factory.mktemp("fleet")
    prefix = f"g{uuid.uuid4().hex[:12]}"
    factory = WorkerFactory(directory, redis_server.url, prefix)
    try:
        worker = factory.start("gw-worker", max_concurrency=8)
        yield Fleet(redis_server.url, prefix, worker)
    finally:
        factory.kill_all()
        print(factory.report())


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
