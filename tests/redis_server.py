"""A private redis-server process for tests: free port, own directory, start/stop/restart.

Tests never touch a Redis they did not start. Restart keeps the port and the directory, so a
server started with ``--appendonly yes`` comes back with its data.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


class RedisServer:
    """One redis-server child process on 127.0.0.1."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        directory: Path | None = None,
        binary: str = "redis-server",
    ) -> None:
        found = shutil.which(binary)
        if found is None:
            raise RuntimeError(
                f"{binary!r} is not on PATH: these tests need a real Redis server binary "
                "(install the redis-server package, e.g. `apt-get install redis-server`)"
            )
        self.binary = found
        self._picked_port = port is None
        self.port = port if port is not None else free_port()
        self.extra_args = list(extra_args)
        self._owns_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="redis-test-"))
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        """Start the server and return once it answers PING."""
        for _attempt in range(3):
            try:
                self._start(timeout)
                self._picked_port = False  # a restart must come back on the same port
                return
            except PortTaken:
                if not self._picked_port:
                    raise
                # Someone took the free port between probing and binding: pick another.
                self.port = free_port()
        raise RuntimeError("redis-server found no free port in 3 attempts")

    def _start(self, timeout: float) -> None:
        if self.process is not None:
            raise RuntimeError("redis-server is already running")
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.directory),
            *self.extra_args,  # later options override the defaults above
        ]
        log_path = self.directory / "redis.log"
        self._log_start = log_path.stat().st_size if log_path.exists() else 0
        log = log_path.open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                tail = self.log_tail(since_start=True)
                if "Address already in use" in tail:
                    raise PortTaken(tail)
                raise RuntimeError(f"redis-server exited at start: {tail}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {timeout} s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL if it lingers)."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop, and delete the data directory if this object created it."""
        self.stop()
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, lines: int = 20, *, since_start: bool = False) -> str:
        """The server's last log lines (only this run's with ``since_start``)."""
        path = self.directory / "redis.log"
        if not path.exists():
            return ""
        with path.open("rb") as log:
            log.seek(self._log_start if since_start else 0)
            text = log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _answers_ping(self) -> bool:
        """True once the server answers a raw PING (a client library would retry for us)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as connection:
                connection.sendall(b"PING\r\n")
                reply = connection.recv(64)
        except OSError:
            return False
        # "+PONG", or "-NOAUTH ..." from a password-protected server: either way it is up.
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class PortTaken(RuntimeError):
    """The server could not bind its port."""


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
