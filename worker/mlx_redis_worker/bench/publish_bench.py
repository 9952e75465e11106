"""``mlx-worker bench publish``: what publishing one engine step's deltas costs the worker.

The worker's event loop shares the GIL with the engine thread, so every microsecond it spends
turning a step's outputs into Redis commands is taken from the engine in host-bound serving
(a fast GPU, small models, big batches). For each batch size N, N streams get one delta per
step, as at ``stream_interval=1``, through:

- **shipped**: ``EventPublisher.on_step``, then its flush task sends every event of the step in
  one call of the PUBLISH_EVENTS script;
- **baseline**: the same publisher sending one script call per event, all in one pipeline (one
  round trip too, but one command for redis-py to pack and parse per event: how the publisher
  worked before).

Reported: CPU time of the event loop thread per event (its own work, whatever else the machine
does) and wall time per step against a private redis-server; the paths alternate.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping

from redis.asyncio import Redis

from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script_each
from mlx_redis_protocol.messages import Event
from mlx_redis_protocol.replay_log import (
    PUBLISH_EVENTS,
    Outcome,
    begin_attempt,
    new_run,
    publish_call,
)
from mlx_redis_worker.daemon.publisher import EventPublisher
from mlx_redis_worker.engine import RequestOutput
from mlx_redis_worker.local_redis import local_redis

Step = Callable[[], Awaitable[None]]
LOG_TTL = 600


class PerEventPublisher(EventPublisher):
    """The publisher as it was: the same bookkeeping, one script call per event (pipelined)."""

    async def _send(self, events: list[Event], runs: Mapping[str, str]) -> list[Outcome]:
        calls = [
            publish_call(self.keys, [event], self.log_ttl, runs, sharded=False) for event in events
        ]
        replies = await run_script_each(self.redis, PUBLISH_EVENTS, calls)
        return [Outcome(reply[0]) for reply in replies]


def publishing(
    publisher: EventPublisher, batch: int, name: str, flushers: list[asyncio.Task[None]]
) -> Step:
    """The worker's path: the step listener, then the publisher's flush task (kept in
    ``flushers``, for the caller to cancel) sends it."""
    outputs = [
        RequestOutput(request_id=f"{name}-{i}", new_text=" word", new_token_ids=[1234])
        for i in range(batch)
    ]
    flusher: asyncio.Task[None] | None = None

    async def step() -> None:
        nonlocal flusher
        if flusher is None:
            flusher = asyncio.create_task(publisher.run())
            flushers.append(flusher)
            for output in outputs:  # begun as a worker begins them: the fence must let them in
                run = new_run()
                await begin_attempt(publisher.redis, publisher.keys, output.request_id, 1, 60, run)
                publisher.open(output.request_id, attempt=1, run=run, first_seq=1, metadata=None)
        publisher.on_step(outputs)
        if not await publisher.drain(timeout=30):
            raise RuntimeError("the publisher did not flush within 30 s")
        if publisher.fenced or publisher.log_gaps:  # refused events cost less: not a measure
            raise RuntimeError(f"Redis refused events: {publisher.stats()}")

    return step


async def measure(step: Step, batch: int, steps: int) -> tuple[float, float]:
    """(event-loop CPU µs per event, wall ms per step) over ``steps`` steps."""
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        await step()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return cpu / (steps * batch) * 1e6, wall / steps * 1e3


async def bench(url: str, batches: list[int], steps: int, repeat: int) -> list[str]:
    redis = Redis.from_url(url)
    keys = Keys(f"benchpublish{time.monotonic_ns()}")
    rows = [
        "| streams (events per step) | path | CPU µs / event | wall ms / step |",
        "|---:|---|---:|---:|",
    ]
    ratios = []
    flushers: list[asyncio.Task[None]] = []
    try:
        for batch in batches:
            paths = {
                "shipped (one script call per step)": publishing(
                    EventPublisher(redis=redis, keys=keys, log_ttl=LOG_TTL),
                    batch,
                    f"shipped{batch}",
                    flushers,
                ),
                "baseline (one script call per event)": publishing(
                    PerEventPublisher(redis=redis, keys=keys, log_ttl=LOG_TTL),
                    batch,
                    f"baseline{batch}",
                    flushers,
                ),
            }
            for step in paths.values():  # warm up: connections, script cache
                await step()
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
            for _ in range(repeat):  # A B A B ...: drift hits both alike
                for name, step in paths.items():
                    results[name].append(await measure(step, batch, max(steps // batch, 20)))
            for name, values in results.items():
                rows.append(
                    f"| {batch} | {name} | {statistics.median(v[0] for v in values):.1f} | "
                    f"{statistics.median(v[1] for v in values):.2f} |"
                )
            ours, base = results.values()
            ratios.append(
                f"  {batch} streams: baseline / shipped CPU per event = "
                f"{statistics.median(b[0] / o[0] for o, b in zip(ours, base, strict=True)):.2f}x"
            )
    finally:
        for task in flushers:
            task.cancel()
        await asyncio.gather(*flushers, return_exceptions=True)
        await redis.aclose()
    return [*rows, "", "Same run, paired rotations (median of per-rotation ratios):", *ratios]


def run_publish_bench(args: argparse.Namespace) -> int:
    batches = [int(b) for b in str(args.batch).split(",")]
    with local_redis(args.redis_url) as (url, what):
        print(f"Redis: {what}; {args.repeat} rotations, ~{args.events} events per measurement")
        print("\n".join(asyncio.run(bench(url, batches, args.events, args.repeat))))
    return 0
