"""One private redis-server child process: free port, own directory, start/stop/restart/kill.

Nothing here touches a Redis it did not start. Restart keeps the port and the directory, so a
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

HOST = "127.0.0.1"
MAX_PORT = 65535


class RedisServer:
    """One redis-server child process on 127.0.0.1.

    ``config_file`` goes before every other argument, which is where redis-server wants it;
    Sentinel needs one (it rewrites it, so it must be writable)."""

    host = HOST

    def __init__(
        self,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        directory: Path | None = None,
        binary: str = "redis-server",
        config_file: Path | None = None,
    ) -> None:
        found = shutil.which(binary)
        if found is None:
            raise RuntimeError(
                f"{binary!r} is not on PATH: this needs a real Redis server binary "
                "(install the redis-server package, e.g. `apt-get install redis-server`)"
            )
        self.binary = found
        self._picked_port = port is None
        self.port = port if port is not None else free_port()
        self.extra_args = list(extra_args)
        self.config_file = config_file
        self._owns_directory = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="local-redis-"))
        self.process: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The running process's id; None while stopped."""
        return None if self.process is None else self.process.pid

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
        command = [self.binary]
        if self.config_file is not None:
            command.append(str(self.config_file))
        command += [
            "--port",
            str(self.port),
            "--bind",
            self.host,
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
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
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

    def kill(self) -> None:
        """SIGKILL the server and reap it: a crash, with no shutdown save or goodbye to peers."""
        process, self.process = self.process, None
        if process is None:
            return
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
            with socket.create_connection((self.host, self.port), timeout=0.5) as connection:
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
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def free_port_pair(offset: int = 10000, attempts: int = 100) -> int:
    """A port ``p`` with ``p`` and ``p + offset`` both free and ``p + offset <= 65535``.

    A Cluster node binds its bus port at ``port + 10000``; the kernel's ephemeral ports run up
    to about 61000, so a plain free port often has no room above it."""
    for _attempt in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((HOST, 0))
            port: int = probe.getsockname()[1]
            if port + offset > MAX_PORT:
                continue
            if _bindable(port + offset):
                return port
    raise RuntimeError(f"no free port pair {offset} apart in {attempts} attempts")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
        return True
