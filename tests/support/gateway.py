"""Gateway processes as tests run them: ``mlx-worker gateway`` children on free ports."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlx_redis_worker.local_redis import free_port
from tests.support.environment import clean_environment
from tests.support.processes import WORKER_COMMAND, json_lines
from tests.support.waiting import wait_until


class GatewayProcess:
    """One ``mlx-worker gateway`` child, its log in ``directory/gateway-N.log``."""

    def __init__(
        self,
        directory: Path,
        *,
        redis_url: str,
        prefix: str,
        flags: Sequence[str] = (),
        program: Sequence[str] = WORKER_COMMAND,
    ) -> None:
        """``program``: the ``mlx-worker`` command to run (another venv's, say)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = directory / f"gateway-{self.port}.log"
        self.command = [
            *program,
            "--log-format",
            "json",
            "gateway",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
            *flags,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url``."""
        return f"{self.url}/v1"

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=clean_environment()
            )
        wait_until(self._healthy, timeout, lambda: f"the gateway to answer:\n{self.log_tail()}")
        return self

    def _healthy(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the gateway exited:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            return None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_events(self) -> list[dict[str, Any]]:
        """The JSON log lines of every run."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return json_lines(text)


class GatewayFactory:
    """Starts the gateways of a test module; stops them at its end."""

    def __init__(self, directory: Path, redis_url: str, prefix: str) -> None:
        self.directory = directory
        self.redis_url = redis_url
        self.prefix = prefix
        self.started: list[GatewayProcess] = []

    def start(self, *flags: str) -> GatewayProcess:
        gateway = GatewayProcess(
            self.directory, redis_url=self.redis_url, prefix=self.prefix, flags=flags
        )
        self.started.append(gateway)
        return gateway.start()

    def stop_all(self) -> None:
        for gateway in self.started:
            with contextlib.suppress(Exception):
                gateway.stop()

    def report(self) -> str:
        return "\n".join(
            f"----- gateway {gateway.url} -----\n{gateway.log_tail(60)}" for gateway in self.started
        )
