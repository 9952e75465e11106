"""Short-lived clients and polling for the multi-process set-ups (Cluster, Sentinel)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import redis

from mlx_redis_worker.local_redis.server import HOST


@contextlib.contextmanager
def connect(port: int) -> Iterator[redis.Redis]:
    """A plain client on one port with short timeouts: a node that hangs must fail the poll
    rather than stall it, and a hung wait has a clear deadline."""
    client = redis.Redis(
        host=HOST,
        port=port,
        socket_connect_timeout=1.0,
        socket_timeout=1.0,
        decode_responses=True,
    )
    try:
        yield client
    finally:
        client.close()


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``check`` until it holds (True) or ``timeout`` passes (False). A check that raises a
    connection or server error counts as not yet: nodes refuse or stall while they come up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return True
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
