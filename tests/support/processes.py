"""Worker processes and the ``mlx-worker`` command line, as tests run them.

``WorkerProcess`` is one ``mlx-worker run`` child with its own log file; ``WorkerFactory``
starts the workers of one test and kills whatever is left at its end; ``mlx_worker`` runs one
command of the CLI to its end.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import MovedError, RedisError

from mlx_redis_protocol.keys import Keys
from tests.support.environment import FAST_ENV, clean_environment
from tests.support.waiting import wait_until

# The console script a service manager runs (ExecStart, ProgramArguments); `python -m
# mlx_redis_worker.cli` where the venv has none.
_SCRIPT = Path(sys.executable).with_name("mlx-worker")
WORKER_COMMAND = (
    (str(_SCRIPT),) if _SCRIPT.exists() else (sys.executable, "-m", "mlx_redis_protocol.cli")
)

# The model test workers serve (its fleet name too): jobs naming no model run on it, from its
# stream (``keys.model_stream(MODEL)``), where its dead letters go as well.
MODEL = "tiny"

# Loading the model and joining the group takes a few seconds alone on a quiet machine.
READY_TIMEOUT = 60.0


def mlx_worker(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run ``mlx-worker ARGS`` to its end in a clean environment (plus ``env``); its output
    as text. ``timeout`` only guards against a hang."""
    return subprocess.run(
        [*WORKER_COMMAND, *args],
        capture_output=True,
        text=True,
        env=clean_environment(env),
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def setting_flags(**settings: float | str | None) -> list[str]:
    """``--max-concurrency 4`` for ``max_concurrency=4``; a setting given as None is left to
    the worker's own default."""
    flags: list[str] = []
    for name, value in settings.items():
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


class WorkerProcess:
    """One ``mlx-worker run`` child process, its log in ``directory/worker-ID.log``.

    ``start`` again after a kill keeps the worker id, so the new process reads its own
    pending jobs first; each start appends to the log, after a ``=== start`` line.
    """

    def __init__(
        self,
        worker_id: str,
        directory: Path,
        *,
        prefix: str,
        redis_url: str | None = None,
        model: str = MODEL,
        cache_dir: Path | None = None,
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        ready_timeout: float = READY_TIMEOUT,
        program: Sequence[str] = WORKER_COMMAND,
    ) -> None:
        """``redis_url`` None: the worker finds it itself (``MLXW_REDIS_URL_FILE``); ``env``:
        the variables on top of the clean environment (the caller's fast intervals among
        them); ``cwd``: the worker's working directory (this process's by default);
        ``program``: the ``mlx-worker`` command to run (another venv's, say)."""
        self.worker_id = worker_id
        self.redis_url = redis_url
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.log_path = directory / f"worker-{worker_id}.log"
        url_flags = ["--redis-url", redis_url] if redis_url is not None else []
        self.command = [
            *program,
            "--log-format",
            "json",
            "run",
            "--model",
            model,
            "--prefix",
            prefix,
            "--worker-id",
            worker_id,
            *url_flags,
            "--cache-dir",
            str(cache_dir if cache_dir is not None else directory / "caches"),
            *flags,
        ]
        self.env = clean_environment(env)
        self.cwd = cwd
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._run_offset = 0  # where this run's lines begin in the log

    # -- the process ----------------------------------------------------------------------

    def start(self) -> WorkerProcess:
        self.starts += 1
        with self.log_path.open("ab") as log:
            header = f"=== start {self.starts} at {time.time():.3f}: {' '.join(self.command)}\n"
            log.write(header.encode())
            log.flush()
            self._run_offset = log.tell()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def check_running(self) -> None:
        """Fail, with the log's tail, when the process has exited."""
        if not self.running():
            raise AssertionError(
                f"worker {self.worker_id} exited (rc={self.returncode()}):\n{self.log_tail()}"
            )

    def wait_ready(self, timeout: float | None = None) -> WorkerProcess:
        """Block until this run of the process logged ``worker_ready``; fail at once if it
        exits first. The log, not the heartbeat: it tells whatever Redis the worker serves
        from (a Cluster, a Sentinel master), and whatever an earlier process under the same
        id left in Redis."""

        def ready() -> bool:
            if self.serving():
                return True
            self.check_running()
            return False

        limit = timeout if timeout is not None else self.ready_timeout
        wait_until(ready, limit, lambda: f"worker {self.worker_id} to serve:\n{self.log_tail()}")
        return self

    def serving(self) -> bool:
        """Whether this run (since the last start) logged ``worker_ready``."""
        events = json_lines(self._log_since_start())
        return any(event.get("event") == "worker_ready" for event in events)

    def heartbeat_alive(self) -> bool:
        """Whether the worker's heartbeat key exists (a single server's URL, or a Cluster
        node's: a MOVED reply says which)."""
        assert self.redis_url is not None, "the heartbeat is read through the worker's URL"
        options: dict[str, Any] = {"socket_timeout": 2, "socket_connect_timeout": 2}
        client: redis.Redis | redis.RedisCluster = redis.Redis.from_url(self.redis_url, **options)
        try:
            try:
                return bool(client.exists(self.keys.worker(self.worker_id)))
            except MovedError:
                client.close()
            client = redis.RedisCluster.from_url(self.redis_url, **options)
            return bool(client.exists(self.keys.worker(self.worker_id)))
        except RedisError:
            return False
        finally:
            client.close()

    def rss(self) -> int:
        """The process's resident memory in bytes (VmRSS; 0 once it is gone)."""
        if not self.running():
            return 0
        try:
            with open(f"/proc/{self.pid}/status", encoding="ascii", errors="replace") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0

    # -- stopping -------------------------------------------------------------------------

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. The exit status of the
        graceful stop (None when it had to be killed)."""
        if self.process is None or not self.running():
            return self.returncode()
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL (no drain, no clean-up at all) and reap."""
        if self.process is None:
            return
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    # -- the log --------------------------------------------------------------------------

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_events(self) -> list[dict[str, Any]]:
        """The JSON log lines of every run."""
        return json_lines(self.log_text())

    def _log_since_start(self) -> str:
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(self._run_offset)
            return log.read().decode(errors="replace")


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects of a log; other lines, and a last line still being written, skipped."""
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return events


class WorkerFactory:
    """Starts the workers of one test (the tiny model, FAST_ENV) and kills whatever is left at
    its end; ``report`` shows their logs when the test failed."""

    def __init__(self, directory: Path, redis_url: str, prefix: str) -> None:
        self.directory = directory
        self.redis_url = redis_url
        self.prefix = prefix
        self.started: list[WorkerProcess] = []

    def start(
        self,
        worker_id: str,
        *,
        redis_url: str | None = None,
        prefix: str | None = None,
        model: str = MODEL,
        cache_dir: Path | None = None,
        max_concurrency: int | None = 4,
        lease_seconds: float | None = 5.0,
        max_deliveries: int | None = None,
        drain_timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
    ) -> WorkerProcess:
        """A started worker; with ``wait``, serving and its heartbeat visible (tests read the
        heartbeat right after a start). A setting given as None is the worker's default."""
        flags = setting_flags(
            max_concurrency=max_concurrency,
            lease_seconds=lease_seconds,
            heartbeat_interval=FAST_ENV["MLXW_HEARTBEAT_INTERVAL"],
            max_deliveries=max_deliveries,
            drain_timeout=drain_timeout,
        )
        process = WorkerProcess(
            worker_id,
            self.directory,
            prefix=prefix or self.prefix,
            redis_url=redis_url or self.redis_url,
            model=model,
            cache_dir=cache_dir,
            flags=flags,
            env={**FAST_ENV, **(env or {})},
        )
        self.started.append(process)
        process.start()
        if wait:
            process.wait_ready()
            wait_until(process.heartbeat_alive, READY_TIMEOUT, f"{worker_id}'s heartbeat")
        return process

    def kill_all(self) -> None:
        for process in self.started:
            with contextlib.suppress(Exception):
                process.kill()

    def report(self) -> str:
        return "\n".join(
            f"----- worker {process.worker_id} (rc={process.returncode()}) "
            f"{process.log_path} -----\n{process.log_tail(60)}"
            for process in self.started
        )
