"""The gateway as systemd runs it (``Type=notify``, a watchdog): a real ``mlx-worker gateway``
child under a fake notify socket says READY=1 once it listens, pings the watchdog from its
event loop, and says STOPPING=1 on SIGTERM, then stops."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

import pytest

from mlx_redis_worker.local_redis import RedisServer
from tests.ops.helpers import NotifySocket
from tests.support.environment import clean_environment
from tests.support.gateway import GatewayProcess
from tests.support.waiting import wait_until


@pytest.mark.timeout(120)
def test_the_gateway_is_ready_once_it_listens_pings_the_watchdog_and_says_stopping(
    tmp_path: Path, redis_server: RedisServer, prefix: str
) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    gateway = GatewayProcess(tmp_path, redis_url=redis_server.url, prefix=prefix)
    environment = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    with gateway.log_path.open("ab") as log:
        process = subprocess.Popen(
            gateway.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_environment(environment),
        )

    def seen(line: str) -> list[str] | None:
        assert process.poll() is None, gateway.log_tail()
        lines = notify.lines()
        return lines if line in lines else None

    try:
        lines = wait_until(lambda: seen("READY=1"), 60, "READY=1")
        assert lines[0] == "READY=1"
        assert f"STATUS=serving on 127.0.0.1:{gateway.port}" in lines
        # By READY=1 the socket listens: what systemd starts after it can connect at once.
        socket.create_connection(("127.0.0.1", gateway.port), timeout=5).close()
        # Its start-up heap is out of the full collections.
        listening = [e for e in gateway.log_events() if e.get("event") == "gateway_listening"]
        assert listening and listening[0]["frozen_objects"] > 10_000, gateway.log_tail()
        # Pings every WATCHDOG_USEC / 2 = 0.5 s, from the event loop.
        wait_until(lambda: notify.lines().count("WATCHDOG=1") >= 3, 10, "three watchdog pings")
        process.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal it caught once it has shut down: systemd counts a
        # death by the unit's KillSignal as a clean stop.
        assert process.wait(45) in (0, -signal.SIGTERM), gateway.log_tail()
        lines = notify.lines()
        assert lines.index("READY=1") < lines.index("WATCHDOG=1") < lines.index("STOPPING=1")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        notify.close()
        print(gateway.log_tail())
