"""Worker subprocesses, greedy references and process memory for the reliability drivers."""

from __future__ import annotations

# `worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import worker  # noqa: F401  # isort: skip

import contextlib
import dataclasses
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisError

from protocol.keys import Keys
from worker.daemon.settings import ENV_PREFIX, WorkerSettings

# Fast failure detection, as the issue asks: leases of 2 s, reclaim every 0.5 s.
WORKER_ENV: Mapping[str, str] = {
    "MLXW_RECLAIM_INTERVAL": "0.5",
    "MLXW_HEARTBEAT_INTERVAL": "0.5",
    "MLXW_HEARTBEAT_TTL": "2",
    "MLXW_DRAIN_TIMEOUT": "2",
}


def worker_command() -> list[str]:
    """The venv's ``mlx-worker`` script (``python -m worker.cli`` when it is missing)."""
    script = Path(sys.executable).with_name("mlx-worker")
    return [str(script)] if script.exists() else [sys.executable, "-m", "worker.cli"]


def clean_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without inherited worker settings, plus ``extra``."""
    names = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(WorkerSettings)}
    names |= {"MLXW_CONFIG", "MLXW_LOG_FORMAT", "MLXW_LOG_LEVEL"}
    env = {k: v for k, v in os.environ.items() if k not in names}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, from /proc (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


class WorkerProcess:
    """One ``mlx-worker run`` child; ``start`` again after a kill keeps its worker id, so the
    new process reads its own pending jobs first."""

    def __init__(
        self,
        worker_id: str,
        redis_url: str,
        prefix: str,
        log_dir: Path,
        *,
        max_concurrency: int = 8,
        lease_seconds: float = 2.0,
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.redis_url = redis_url
        self.keys = Keys(prefix)
        self.log_path = log_dir / f"worker-{worker_id}.log"
        self.command = [
            *worker_command(),
            "--log-format",
            "json",
            "run",
            "--model",
            "tiny",
            "--redis-url",
            redis_url,
            "--prefix",
            prefix,
            "--worker-id",
            worker_id,
            "--max-concurrency",
            str(max_concurrency),
            "--lease-seconds",
            str(lease_seconds),
            "--cache-dir",
            str(log_dir / "caches"),
            *flags,
        ]
        self.env = clean_environment({**WORKER_ENV, **(env or {})})
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> WorkerProcess:
        with self.log_path.open("ab") as log:
            log.write(f"=== start {self.starts + 1} at {time.time():.3f}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        self.starts += 1
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def rss(self) -> int:
        return rss_bytes(self.pid) if self.running() else 0

    def heartbeat_alive(self) -> bool:
        client = redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            return bool(client.exists(self.keys.worker(self.worker_id)))
        except RedisError:
            return False
        finally:
            client.close()

    def wait_ready(self, timeout: float = 120.0) -> WorkerProcess:
        """Block until this run of the process logged ``worker_ready``. The log, not the
        heartbeat: it works whatever Redis the worker serves from (a Cluster, a Sentinel
        master), and an earlier process's heartbeat may outlive a kill."""
        deadline = time.monotonic() + timeout
        while not self.serving():
            if not self.running():
                raise AssertionError(
                    f"worker {self.worker_id} exited (rc={self.returncode()}):\n" + self.log_tail()
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"worker {self.worker_id} not ready:\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def serving(self) -> bool:
        """Whether the current run (since the last ``=== start`` line) logged worker_ready."""
        current_run = self.log_text().rsplit("=== start", 1)[-1]
        return '"event": "worker_ready"' in current_run

    def kill(self) -> None:
        """SIGKILL: no drain, no clean-up."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit status of
        the graceful stop (None when it had to be killed)."""
        if self.process is None or not self.running():
            return self.returncode()
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
        return events


def exit_now(code: int) -> None:
    """End a driver's process without running C++ static destructors: right after an engine
    closed, MLX's exit can race its own threads and abort (rc 134) though all went well."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_workers(
    count: int, redis_url: str, prefix: str, log_dir: Path, **options: Any
) -> list[WorkerProcess]:
    """Start ``count`` workers (w1..wN) at once, then wait until all serve."""
    workers = [
        WorkerProcess(f"w{i + 1}", redis_url, prefix, log_dir, **options).start()
        for i in range(count)
    ]
    try:
        for process in workers:
            process.wait_ready()
    except BaseException:
        for process in workers:
            process.kill()
        raise
    return workers


# -- greedy references ----------------------------------------------------------------------


@functools.cache
def _reference_model() -> tuple[Any, Any]:
    from worker.models import load_model

    return load_model("tiny")


def first_greedy_token(prompt: str) -> int:
    """The tiny model's first greedy token for ``prompt`` (from an engine in this process)."""
    from worker.engine import EngineCore, SamplingParams

    model, tokenizer = _reference_model()
    engine = EngineCore(model, tokenizer)
    try:
        output = engine.generate_batch_sync([prompt], SamplingParams(max_tokens=1, temperature=0))
    finally:
        engine.close()
    return int(output[0].output_token_ids[0])


def reference_texts(prompts: Sequence[str], max_tokens: int) -> dict[str, str]:
    """Greedy texts of the tiny model for each distinct prompt, from an engine run directly
    in this process (the workers' texts must equal these)."""
    from worker.engine import EngineCore, SamplingParams

    model, tokenizer = _reference_model()
    distinct = list(dict.fromkeys(prompts))
    engine = EngineCore(model, tokenizer)
    try:
        outputs = engine.generate_batch_sync(
            distinct, SamplingParams(max_tokens=max_tokens, temperature=0.0)
        )
    finally:
        engine.close()
    return {prompt: output.output_text for prompt, output in zip(distinct, outputs, strict=True)}


# Syllables, digits and punctuation: short random prompts the tokenizer splits differently.
WORDS = (*(c + v for c in "bdfgklmnprstvz" for v in "aeiou"), *"0123456789!?,.")


def make_prompts(count: int, seed: int, words: tuple[int, int] = (2, 9)) -> list[str]:
    """Distinct prompts of random words (the tiny random model answers each differently)."""
    rng = random.Random(seed)
    found: dict[str, None] = {}
    while len(found) < count:
        found[" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))] = None
    return list(found)
