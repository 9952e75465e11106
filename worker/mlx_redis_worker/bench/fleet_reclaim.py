"""A reclaim sweep at fleet size: ``pending`` jobs left to a consumer that died, taken back by
one live worker's reclaimer (the daemon's ``JobQueue.reclaim``, ``batch`` entries a pass as a
lane takes ``max_concurrency``), pass after pass until its cursor has visited the whole pending
list, while every Redis node is PINGed to show it stays responsive.

The orphans sit in a stream of their own (model ``ORPHAN_MODEL``, which no simulated worker
serves): on the fleet's stream the fleet's own reclaimers would race the one being timed and
try to run jobs that are no jobs. What the sweep takes is acknowledged and deleted between
passes (untimed), as a worker's run would end each, so the fleet is left as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import as_text
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_worker.daemon.job_queue import JobQueue

ORPHAN_MODEL = "sim-orphans"
DEAD_CONSUMER = "dead-worker"
CHUNK = 1000
PING_EVERY = 0.005


@dataclass(frozen=True, slots=True)
class ReclaimResult:
    pending: int
    taken: int  # by the whole sweep
    passes: int
    first_pass_ms: float  # the pass one worker makes each reclaim_interval
    first_taken: int
    sweep_ms: float  # every pass, acknowledgements excluded
    worst_pass_ms: float
    ping_p99_ms: float  # PING of every node, during the sweep
    ping_max_ms: float


async def orphan(client: Client, pending: int, idle_ms: int) -> None:
    """``pending`` entries delivered to ``DEAD_CONSUMER`` and idle for ``idle_ms``."""
    stream = client.keys.model_stream(ORPHAN_MODEL)
    redis: Any = client.redis
    await JobQueue(redis=redis, stream=stream, consumer=DEAD_CONSUMER, lease_ms=1).ensure_group()
    for first in range(0, pending, CHUNK):
        async with redis.pipeline(transaction=False) as pipe:
            for _ in range(min(CHUNK, pending - first)):
                pipe.xadd(stream.stream, {JOB_FIELD: b"orphaned"})
            await pipe.execute()
    read = 0
    while read < pending:
        reply = await redis.xreadgroup(
            stream.group, DEAD_CONSUMER, {stream.stream: ">"}, count=min(CHUNK, pending - read)
        )
        ids = [as_text(entry_id) for entry_id, _ in reply[0][1]] if reply else []
        if not ids:
            raise RuntimeError(f"orphaned {read} of {pending}: the stream ran dry")
        # Idle past the lease, as if its worker died that long ago.
        await redis.xclaim(
            stream.stream, stream.group, DEAD_CONSUMER, 0, ids, idle=idle_ms, justid=True
        )
        read += len(ids)


async def ping_until(stop: asyncio.Event, nodes: Sequence[str], times: list[float]) -> None:
    clients = [aioredis.Redis.from_url(url, socket_timeout=30) for url in nodes]
    try:
        while not stop.is_set():
            for node in clients:
                began = time.perf_counter()
                await node.ping()
                times.append(1000 * (time.perf_counter() - began))
            await asyncio.sleep(PING_EVERY)
    finally:
        for node in clients:
            await node.aclose()


async def reclaim_sweep(
    client: Client, nodes: Sequence[str], pending: int, batch: int, lease_ms: int
) -> ReclaimResult:
    await orphan(client, pending, idle_ms=2 * lease_ms)
    stream = client.keys.model_stream(ORPHAN_MODEL)
    redis: Any = client.redis
    queue = JobQueue(redis=redis, stream=stream, consumer="sweeper", lease_ms=lease_ms)
    pings: list[float] = []
    stop = asyncio.Event()
    pinger = asyncio.create_task(ping_until(stop, nodes, pings))
    passes, taken, first_ms, first_taken, sweep_ms, worst = 0, 0, 0.0, 0, 0.0, 0.0
    try:
        while True:
            began = time.perf_counter()
            claimed = await queue.reclaim(batch)
            ms = 1000 * (time.perf_counter() - began)
            if passes == 0:
                first_ms, first_taken = ms, len(claimed)
            passes += 1
            taken += len(claimed)
            sweep_ms += ms
            worst = max(worst, ms)
            if claimed:
                await queue.ack(*(d.entry_id for d in claimed))
            if queue.swept or passes > pending + 1:
                break
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await pinger
        await redis.delete(stream.stream)
    pings.sort()
    return ReclaimResult(
        pending=pending,
        taken=taken,
        passes=passes,
        first_pass_ms=first_ms,
        first_taken=first_taken,
        sweep_ms=sweep_ms,
        worst_pass_ms=worst,
        ping_p99_ms=pings[min(len(pings) - 1, int(0.99 * len(pings)))] if pings else float("nan"),
        ping_max_ms=pings[-1] if pings else float("nan"),
    )
