"""The key names of the protocol tests' per-test prefix (the redis-server and the prefix are
tests/conftest.py's)."""

from __future__ import annotations

import pytest

from mlx_redis_protocol.keys import Keys


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)
