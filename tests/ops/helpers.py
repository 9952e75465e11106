"""Worker subprocesses, a fake systemd notify socket and the ops scripts, for the service tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
VENV = Path(sys.prefix)

# The console script a service manager runs (ExecStart / ProgramArguments), when installed.
_SCRIPT = Path(sys.executable).parent / "mlx-worker"
WORKER_COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "worker.cli"]

# Variables that would leak the developer's settings (or a real systemd's socket) into a test.
_INHERITED = ("MLXW_", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# Periodic tasks (heartbeat, metrics refresh) every half second, so tests need not wait long.
FAST_ENV = {
    "MLXW_HEARTBEAT_INTERVAL": "0.5",
    "MLXW_HEARTBEAT_TTL": "2",
    "MLXW_READ_BLOCK_MS": "200",
    "MLXW_SOCKET_TIMEOUT": "5",
}


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_INHERITED)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class WorkerProcess:
    """``mlx-worker run`` as a service manager starts it: a child process, logs in a file."""

    def __init__(
        self,
        directory: Path,
        model: str,
        worker_id: str,
        prefix: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.log_path = directory / f"worker-{worker_id}.log"
        command = [
            *WORKER_COMMAND,
            "--log-format",
            "json",
            "run",
            "--model",
            model,
            "--prefix",
            prefix,
            "--worker-id",
            worker_id,
            "--cache-dir",
            str(directory / "caches"),
            *args,
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=clean_env({**FAST_ENV, **(env or {})}),
                cwd=directory,
            )

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_running(self) -> None:
        rc = self.process.poll()
        if rc is not None:
            raise AssertionError(f"worker exited early (rc={rc}):\n{self.log()[-4000:]}")


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
        env=clean_env(env),
        stdin=subprocess.DEVNULL,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, f"{name} {args} failed:\n{completed.stderr}"
    return completed.stdout
