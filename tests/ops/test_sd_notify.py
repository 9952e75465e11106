"""The notify protocol client, against a socket standing in for systemd."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_redis_protocol.sd_notify import Notifier


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(2)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def test_messages_reach_the_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    notifier.ready(status="serving")
    assert sock.recv(4096).decode().splitlines() == ["READY=1", "STATUS=serving"]
    notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    notifier.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    notifier.status("draining 2 jobs")
    assert sock.recv(4096) == b"STATUS=draining 2 jobs"


def test_abstract_namespace_socket() -> None:
    name = f"mlxw-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        Notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert sock.recv(4096) == b"READY=1"


def test_outside_systemd_everything_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.watchdog_interval() is None
    notifier.ready()
    notifier.watchdog()
    notifier.stopping()
    asyncio.run(asyncio.wait_for(notifier.keep_alive(lambda: True), 1))  # returns at once


def test_a_vanished_socket_is_not_fatal(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    notifier.ready()  # logged, not raised


def test_watchdog_interval_is_half_the_timeout() -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "60000000"}
    assert Notifier(env).watchdog_interval() == 30.0
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval() == 30.0
    # Meant for another process (inherited from a watched parent): not ours to ping.
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval() is None
    assert Notifier({**env, "WATCHDOG_USEC": "0"}).watchdog_interval() is None
    assert Notifier({**env, "WATCHDOG_USEC": "x"}).watchdog_interval() is None
    assert Notifier({"WATCHDOG_USEC": "60000000"}).watchdog_interval() is None


def test_keep_alive_pings_only_while_healthy(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    sock.setblocking(False)
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "40000"})  # every 20 ms
    healthy = True

    def received() -> list[bytes]:
        messages = []
        while True:
            try:
                messages.append(sock.recv(4096))
            except BlockingIOError:
                return messages

    async def main() -> tuple[list[bytes], list[bytes]]:
        task = asyncio.create_task(notifier.keep_alive(lambda: healthy))
        await asyncio.sleep(0.2)
        while_healthy = received()
        nonlocal healthy
        healthy = False
        await asyncio.sleep(0.05)  # a ping already under way may still land
        received()
        await asyncio.sleep(0.2)
        while_sick = received()
        task.cancel()
        return while_healthy, while_sick

    while_healthy, while_sick = asyncio.run(main())
    assert len(while_healthy) >= 3 and set(while_healthy) == {b"WATCHDOG=1"}
    assert while_sick == []
