"""A service manager's view for the service tests: the worker started as one starts it, a fake
systemd notify socket, the metrics endpoint, and the ops scripts."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.support.environment import SERVICE_ENV, clean_environment
from tests.support.processes import WorkerProcess
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
VENV = Path(sys.prefix)


def service_worker(
    directory: Path,
    model: str,
    worker_id: str,
    prefix: str,
    *,
    redis_url: str | None = None,
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> WorkerProcess:
    """``mlx-worker run`` as a service manager starts it: in its own working directory, with
    SERVICE_ENV's intervals; started."""
    process = WorkerProcess(
        worker_id,
        directory,
        prefix=prefix,
        redis_url=redis_url,
        model=model,
        flags=flags,
        env={**SERVICE_ENV, **(env or {})},
        cwd=directory,
    )
    return process.start()


class NotifySocket:
    """What systemd listens on for ``Type=notify``: an AF_UNIX datagram socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[str] = []

    def receive(self) -> None:
        with contextlib.suppress(TimeoutError):
            while True:
                self.messages.append(self.sock.recv(4096).decode())

    def lines(self) -> list[str]:
        """Every assignment received so far, in order (a message may hold several)."""
        self.receive()
        return [line for message in self.messages for line in message.splitlines()]

    def wait_for(self, line: str, timeout: float, worker: WorkerProcess) -> list[str]:
        def seen() -> list[str] | None:
            worker.check_running()
            lines = self.lines()
            return lines if line in lines else None

        found: list[str] = wait_until(seen, timeout, line)
        return found

    def close(self) -> None:
        self.sock.close()


def scrape(port: int) -> dict[str, Any]:
    """``/metrics`` as {sample name + labels: value}; metric families listed under ``None``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[Any, Any] = {None: set()}
    for family in text_string_to_metric_families(text):
        samples[None].add(family.name)
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def run_script(name: str, *args: str, env: Mapping[str, str] | None = None) -> str:
    """Run an ops script; returns stdout, raises with stderr when it fails."""
    completed = subprocess.run(
        ["bash", str(OPS / name), *args],
        capture_output=True,
        text=True,
        env=clean_environment(env),
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, f"{name} {args} failed:\n{completed.stderr}"
    return completed.stdout
