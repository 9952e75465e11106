"""The test server helper itself: restart keeps the port, and with AOF the data."""

from __future__ import annotations

import redis

from mlx_redis_worker.local_redis import RedisServer


def test_restart_with_appendonly_keeps_data() -> None:
    with RedisServer(extra_args=["--appendonly", "yes", "--appendfsync", "always"]) as server:
        client = redis.Redis.from_url(server.url)
        client.set("kept", b"yes")
        client.close()
        port = server.port
        server.restart()
        client = redis.Redis.from_url(server.url)
        try:
            assert server.port == port
            assert client.get("kept") == b"yes"
        finally:
            client.close()


def test_stop_is_idempotent_and_close_removes_the_directory() -> None:
    server = RedisServer()
    server.start()
    directory = server.directory
    server.stop()
    server.stop()
    server.close()
    assert not directory.exists()
