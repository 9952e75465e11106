"""The reliability drivers' workers: fast failure detection (leases of 2 s, reclaim every
0.5 s: FAULT_ENV), 8 jobs at a time, and two minutes to start (several load the model at
once on a 2-core machine)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support.environment import FAULT_ENV
from tests.support.processes import WorkerProcess, setting_flags

READY_TIMEOUT = 120.0
# Where several workers share the machine's 2 cores: one BLAS thread each.
ONE_BLAS_THREAD: Mapping[str, str] = {"OPENBLAS_NUM_THREADS": "1"}


def worker_process(
    worker_id: str,
    redis_url: str,
    prefix: str,
    directory: Path,
    *,
    max_concurrency: int = 8,
    lease_seconds: float = 2.0,
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> WorkerProcess:
    """A worker of a reliability run (not started yet)."""
    return WorkerProcess(
        worker_id,
        directory,
        prefix=prefix,
        redis_url=redis_url,
        flags=[
            *setting_flags(max_concurrency=max_concurrency, lease_seconds=lease_seconds),
            *flags,
        ],
        env={**FAULT_ENV, **(env or {})},
        ready_timeout=READY_TIMEOUT,
    )


def start_workers(
    count: int, redis_url: str, prefix: str, directory: Path, **options: Any
) -> list[WorkerProcess]:
    """Start ``count`` workers (w1..wN) at once, then wait until all serve; all are killed
    when one fails to."""
    workers = [
        worker_process(f"w{i + 1}", redis_url, prefix, directory, **options).start()
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
