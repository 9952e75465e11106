"""Local Redis servers for the demo, the benchmarks and the tests.

``local_redis`` gives the demo a Redis: the configured one if it answers, else a private
``redis-server``, else an embedded server (fakeredis over TCP, which speaks streams, consumer
groups, Lua and pub/sub) so the demo runs even on a machine without Redis. ``RedisServer``,
``LocalCluster`` and ``LocalSentinel`` start real servers of each deployment shape.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterator

import redis

from mlx_redis_worker.local_redis.cluster import LocalCluster
from mlx_redis_worker.local_redis.sentinel import LocalSentinel
from mlx_redis_worker.local_redis.server import PortTaken, RedisServer, free_port, free_port_pair

__all__ = [
    "LocalCluster",
    "LocalSentinel",
    "PortTaken",
    "RedisServer",
    "free_port",
    "free_port_pair",
    "local_redis",
]


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


@contextlib.contextmanager
def local_redis(configured_url: str | None, embedded: bool = False) -> Iterator[tuple[str, str]]:
    """Yield ``(url, what)`` of a reachable Redis; stops what it started on exit.
    ``embedded`` skips straight to the embedded server."""
    if not embedded and configured_url and _answers(configured_url):
        yield configured_url, f"configured Redis at {configured_url}"
        return
    if not embedded and shutil.which("redis-server") is not None:
        with RedisServer() as server:
            yield server.url, f"a private redis-server on port {server.port}"
        return
    from fakeredis import TcpFakeServer

    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0", f"an embedded Redis (fakeredis) on port {port}"
    finally:
        server.shutdown()
        server.server_close()
