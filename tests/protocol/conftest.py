"""A real redis-server for the protocol tests, and per-test key prefixes on it."""

from __future__ import annotations

import uuid

import pytest

from protocol.keys import Keys


@pytest.fixture
def prefix() -> str:
    """A prefix of this test's own, so tests sharing the server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)
