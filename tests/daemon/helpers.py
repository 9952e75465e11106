"""Worker subprocesses, stream checks and greedy references for the daemon integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.exceptions import RedisError

from protocol.client import Client
from protocol.keys import Keys
from protocol.messages import DeltaEvent, DoneEvent, ErrorEvent, Event, QueuedEvent, ResetEvent
from worker.daemon.settings import ENV_PREFIX, WorkerSettings

T = TypeVar("T")

# `python -m worker.cli` is the `mlx-worker` entry point without relying on the venv's script.
WORKER_COMMAND = (sys.executable, "-m", "worker.cli")

# Short intervals so reclaiming, heartbeats and reads react within a second in tests.
FAST_ENV: Mapping[str, str] = {
    "MLXW_RECLAIM_INTERVAL": "0.5",
    "MLXW_HEARTBEAT_INTERVAL": "0.5",
    "MLXW_HEARTBEAT_TTL": "2",
    "MLXW_READ_BLOCK_MS": "200",
    "MLXW_SOCKET_TIMEOUT": "5",
}

READY_TIMEOUT = 60.0


def run(coroutine: Awaitable[T]) -> T:
    async def main() -> T:
        return await coroutine

    return asyncio.run(main())


def wait_until(
    condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll a synchronous condition until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def until(
    condition: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll an async condition until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


# -- worker processes -----------------------------------------------------------------------


def clean_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without inherited worker settings, plus ``extra``."""
    names = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(WorkerSettings)}
    names |= {"MLXW_CONFIG", "MLXW_LOG_FORMAT", "MLXW_LOG_LEVEL"}
    env = {k: v for k, v in os.environ.items() if k not in names}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class WorkerProcess:
    """One ``mlx-worker run`` child process with its own log file."""

    def __init__(
        self,
        worker_id: str,
        redis_url: str,
        prefix: str,
        log_path: Path,
        flags: Sequence[str],
        env: Mapping[str, str],
    ) -> None:
        self.worker_id = worker_id
        self.redis_url = redis_url
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.log_path = log_path
        self.command = [
            *WORKER_COMMAND,
            "--log-format",
            "json",
            "--log-level",
            "INFO",
            "run",
            "--model",
            "tiny",
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
            "--worker-id",
            worker_id,
            *flags,
        ]
        self.env = dict(env)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with self.log_path.open("ab") as log:
            log.write(f"=== {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def heartbeat_alive(self) -> bool:
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return bool(client.exists(self.keys.worker(self.worker_id)))
        except RedisError:
            return False
        finally:
            client.close()

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> WorkerProcess:
        """Block until the worker's heartbeat key exists (it is serving)."""
        deadline = time.monotonic() + timeout
        while not self.heartbeat_alive():
            if not self.running():
                raise AssertionError(
                    f"worker {self.worker_id} exited before it was ready "
                    f"(rc={self.returncode()}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"worker {self.worker_id} not ready within {timeout:g} s:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        return self

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL (no clean-up at all) and reap."""
        if self.running():
            self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_events(self) -> list[dict[str, Any]]:
        """The worker's JSON log lines (other lines are skipped)."""
        events = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
        return events


class WorkerFactory:
    """Starts workers for one test and kills whatever is left at its end."""

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
        max_concurrency: int = 4,
        lease_seconds: float = 5.0,
        max_deliveries: int | None = None,
        drain_timeout: float | None = None,
        cache_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
    ) -> WorkerProcess:
        flags = [
            "--max-concurrency",
            str(max_concurrency),
            "--lease-seconds",
            str(lease_seconds),
            "--heartbeat-interval",
            FAST_ENV["MLXW_HEARTBEAT_INTERVAL"],
            "--cache-dir",
            str(cache_dir if cache_dir is not None else self.directory / "caches"),
        ]
        if max_deliveries is not None:
            flags += ["--max-deliveries", str(max_deliveries)]
        if drain_timeout is not None:
            flags += ["--drain-timeout", str(drain_timeout)]
        process = WorkerProcess(
            worker_id,
            redis_url or self.redis_url,
            prefix or self.prefix,
            self.directory / f"worker-{worker_id}.log",
            flags,
            clean_environment({**FAST_ENV, **(env or {})}),
        )
        self.started.append(process)
        process.start()
        if wait:
            process.wait_ready()
        return process

    def kill_all(self) -> None:
        for process in self.started:
            with contextlib.suppress(Exception):
                process.kill()

    def report(self) -> str:
        parts = []
        for process in self.started:
            parts.append(
                f"----- worker {process.worker_id} (rc={process.returncode()}) "
                f"{process.log_path} -----\n{process.log_tail(60)}"
            )
        return "\n".join(parts)


def health(worker_id: str, redis_url: str, prefix: str) -> int:
    """Exit status of ``mlx-worker health``."""
    completed = subprocess.run(
        [
            *WORKER_COMMAND,
            "health",
            "--worker-id",
            worker_id,
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
        ],
        env=clean_environment({}),
        capture_output=True,
        timeout=60,
        check=False,
    )
    return completed.returncode


# -- streams --------------------------------------------------------------------------------


async def collect(client: Client, request_id: str, timeout: float = 60.0) -> list[Event]:
    """Every event of a request, in the order the client yields them, up to the terminal."""
    async with aclosing(client.stream(request_id, timeout=timeout)) as events:
        return [event async for event in events]


async def collect_surviving_restarts(
    client: Client, request_id: str, timeout: float = 60.0, give_up_after: float = 90.0
) -> tuple[list[Event], int]:
    """``collect`` that starts over after a connection error (Redis restarted under it).

    Starting over is enough: a stream merges the replay log from its beginning. Returns the
    events of the stream that completed and how many attempts failed on the way.
    """
    failures = 0
    deadline = time.monotonic() + give_up_after
    while True:
        try:
            return await collect(client, request_id, timeout), failures
        except (RedisError, ConnectionError, OSError) as exc:
            failures += 1
            if time.monotonic() > deadline:
                raise AssertionError(f"stream of {request_id} kept failing: {exc!r}") from exc
            await asyncio.sleep(0.2)


@dataclasses.dataclass
class StreamSummary:
    terminal: DoneEvent | ErrorEvent
    final_text: str  # the deltas after the last reset, concatenated
    resets: list[ResetEvent]
    deltas: list[DeltaEvent]
    attempts: list[int]


def check_stream(events: Sequence[Event], request_id: str) -> StreamSummary:
    """The invariants every finished stream must hold; returns what the tests look at.

    The queued marker has seq 0, then seqs 1..n without a gap or repeat (across attempts),
    exactly one terminal event and it is the last one, attempts never go down and a reset
    starts each new attempt.
    """
    assert events, f"{request_id}: no events"
    assert all(e.request_id == request_id for e in events)
    body = list(events)
    if isinstance(body[0], QueuedEvent):
        assert body[0].seq == 0
        body = body[1:]
    seqs = [e.seq for e in body]
    assert seqs == list(range(1, len(body) + 1)), f"{request_id}: seqs not gapless: {seqs}"
    terminals = [e for e in body if e.terminal]
    assert len(terminals) == 1, f"{request_id}: {len(terminals)} terminal events"
    assert body[-1] is terminals[0], f"{request_id}: events after the terminal one"
    terminal = terminals[0]
    assert isinstance(terminal, DoneEvent | ErrorEvent)
    attempts = [e.attempt for e in body]
    assert attempts == sorted(attempts), f"{request_id}: attempts go down: {attempts}"
    resets = [e for e in body if isinstance(e, ResetEvent)]
    for previous, event in itertools.pairwise(body):
        if event.attempt != previous.attempt:
            assert isinstance(event, ResetEvent), (
                f"{request_id}: attempt {event.attempt} starts without a reset: {event}"
            )
    final_text = ""
    for event in body:
        if isinstance(event, ResetEvent):
            final_text = ""
        elif isinstance(event, DeltaEvent):
            final_text += event.new_text
    if isinstance(terminal, DoneEvent):
        assert final_text == terminal.output_text, f"{request_id}: deltas != output_text"
    return StreamSummary(
        terminal=terminal,
        final_text=final_text,
        resets=resets,
        deltas=[e for e in body if isinstance(e, DeltaEvent)],
        attempts=sorted(set(attempts)),
    )


async def log_length(client: Client, request_id: str) -> int:
    """Entries in the request's replay log (the queued marker included)."""
    return int(await client.redis.xlen(client.keys.log(request_id)))


async def pending_ids(client: Client) -> dict[str, str]:
    """Pending entries of the job group: entry id -> consumer."""
    keys = client.keys
    rows = await client.redis.xpending_range(keys.jobs, keys.group, min="-", max="+", count=1000)
    return {_text(row["message_id"]): _text(row["consumer"]) for row in rows}


async def settled(client: Client) -> bool:
    """Every job entry acknowledged (nothing pending) and deleted from the job stream.

    A worker acknowledges after the terminal event is written, so a client can see ``done``
    a moment before this turns true: wait for it with ``until``.
    """
    return not await pending_ids(client) and await client.redis.xlen(client.keys.jobs) == 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Syllables, digits and punctuation: short random prompts the tokenizer splits differently.
WORDS = (*(c + v for c in "bdfgklmnprstvz" for v in "aeiou"), *"0123456789!?,.")


def prompts(count: int, seed: int) -> list[str]:
    """Distinct prompts of 2-9 random words: the tiny random model answers each differently."""
    rng = random.Random(seed)
    found: dict[str, None] = {}
    while len(found) < count:
        found[" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))] = None
    return list(found)
