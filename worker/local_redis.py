"""A Redis for the demo: the configured one if it answers, else a private ``redis-server``,
else an embedded server (fakeredis over TCP, which speaks streams, consumer groups, Lua and
pub/sub) so the demo runs even on a machine without Redis."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import redis


def _answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def local_redis(configured_url: str | None, embedded: bool = False) -> Iterator[tuple[str, str]]:
    """Yield ``(url, what)`` of a reachable Redis; stops what it started on exit.
    ``embedded`` skips straight to the embedded server."""
    if not embedded and configured_url and _answers(configured_url):
        yield configured_url, f"configured Redis at {configured_url}"
        return
    binary = None if embedded else shutil.which("redis-server")
    if binary is not None:
        port = _free_port()
        directory = tempfile.mkdtemp(prefix="mlxw-demo-redis-")
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                directory,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + 10
            while not _answers(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
            yield url, f"a private redis-server on port {port}"
        finally:
            process.terminate()
            process.wait(timeout=10)
            shutil.rmtree(directory, ignore_errors=True)
        return
    from fakeredis import TcpFakeServer

    port = _free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{port}/0", f"an embedded Redis (fakeredis) on port {port}"
    finally:
        server.shutdown()
        server.server_close()
