"""A worker process for a bench that measures through Redis: ``mlx-worker run`` started with
its log in the temporary folder, waited for until it serves its models, stopped at the end.
One way for every bench (end to end, models, fairness, gateway, isolation, keyspace)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mlx_redis_protocol.catalogue import live_heartbeats
from mlx_redis_protocol.client import Client
from mlx_redis_worker.daemon.settings import parse_models

READY_TIMEOUT = 180.0


@dataclass(frozen=True, slots=True)
class Worker:
    worker_id: str
    models: tuple[str, ...]  # the names it serves (what its heartbeat lists once it serves)
    process: subprocess.Popen[bytes]
    log_path: str


def start_worker(
    url: str,
    prefix: str,
    worker_id: str,
    models: Sequence[str],
    concurrency: int,
    *options: str,
) -> Worker:
    """``models``: each a ``--model`` value, ``[NAME=]SOURCE``; ``options``: more flags of
    ``mlx-worker run`` (``--fair-share``, say)."""
    command = [
        sys.executable,
        "-m",
        "mlx_redis_protocol.cli",
        "--log-level",
        "WARNING",
        "run",
        *(flag for model in models for flag in ("--model", model)),
        "--redis-url",
        url,
        "--prefix",
        prefix,
        "--worker-id",
        worker_id,
        "--max-concurrency",
        str(concurrency),
        *options,
    ]
    names = tuple(served.name for model in models for served in parse_models(model))
    log_path = os.path.join(tempfile.gettempdir(), f"mlxw-{worker_id}.log")
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return Worker(worker_id, names, process, log_path)


def stop_worker(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        # Still draining (a prompt of 30k tokens in prefill, say): killed, so that the
        # bench's own error, if any, is what it reports, not this teardown's.
        process.kill()
        process.wait(timeout=60)


async def wait_ready(client: Client, workers: Sequence[Worker]) -> None:
    """Each worker answers a ping addressed to it and the fleet registry lists it with its
    models: what a client reads before it queues a job naming a model. A worker writes its
    heartbeat key before its registry member, so a ready test on the key alone could pass in
    that gap, and the first jobs would end ``unknown_model`` (the likeliest cause of "2 of 2
    jobs failed" in ``bench models`` under load, where the gap is widest)."""
    deadline = time.monotonic() + READY_TIMEOUT
    for worker in workers:
        wanted = set(worker.models)
        while True:
            if worker.process.poll() is not None:
                raise RuntimeError(
                    f"worker {worker.worker_id} exited during start-up (exit status "
                    f"{worker.process.returncode}); its log: {worker.log_path}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker {worker.worker_id} was not serving {sorted(wanted)} within "
                    f"{READY_TIMEOUT:.0f} s; its log: {worker.log_path}"
                )
            with contextlib.suppress(Exception):  # not up yet
                if await client.ping(worker_id=worker.worker_id, timeout=1):
                    beats = await live_heartbeats(client.redis, client.keys)
                    if any(
                        beat.worker_id == worker.worker_id and wanted <= set(beat.models)
                        for beat in beats
                    ):
                        break
            await asyncio.sleep(0.5)
