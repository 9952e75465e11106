"""A real redis-server for the protocol tests, and per-test key prefixes on it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from protocol.keys import Keys
from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private server for the whole session (never the Redis on 6379)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def prefix() -> str:
    """A prefix of this test's own, so tests sharing the server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)
