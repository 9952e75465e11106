"""``mlx-worker bench keyspace``: the request path's cost with a million unrelated keys in Redis.

Two private redis-servers, each with one worker (the tiny model, same flags): **empty** holds
only the fleet's keys, **filled** holds ``--keys`` (1,000,000) unrelated keys besides (another
application's data, made with ``DEBUG POPULATE``). Rotations alternate between the two (A B A B
…), so drift hits both alike. Each rotation times, on each server, ``--samples`` of:

* ``Client.stats()``: a broadcast control command, which counts the live workers it waits for;
* ``submit --model`` to the first token: a fresh client (no cached catalogue) checks that a
  worker serves the model, queues the job and follows it to its first delta;
* for scale, the catalogue read as it was before the registry: ``SCAN`` for the heartbeat keys
  (1000 per call), then ``GET`` each.

Reported: median and p90 milliseconds per server, and the ratio filled / empty of the medians
(the goal: at most 1.2 for the first two; issue 25 measured 40x and 17x before).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DeltaEvent
from mlx_redis_worker.bench.e2e_bench import pct
from mlx_redis_worker.bench.models_bench import Model, start_worker
from mlx_redis_worker.bench.worker_process import Worker, stop_worker, wait_ready
from mlx_redis_worker.local_redis import RedisServer

EMPTY, FILLED = "empty", "filled"
SERVERS = (EMPTY, FILLED)
STATS = "Client.stats()"
FIRST_TOKEN = "submit --model to 1st token"
SCAN_READ = "catalogue by SCAN (before)"
MEASURES = (STATS, FIRST_TOKEN, SCAN_READ)
PREFIX = "mlxw"
MODEL = "tiny"
GOAL = 1.2


@dataclass(slots=True)
class Samples:
    """Seconds per measure and server, over every rotation."""

    by: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, measure: str, server: str, seconds: float) -> None:
        self.by.setdefault((measure, server), []).append(seconds)


async def _timed(samples: int, once: Callable[[], Awaitable[None]]) -> list[float]:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        await once()
        times.append(time.perf_counter() - start)
    return times


async def _stats(url: str, samples: int) -> list[float]:
    async with Client(url, prefix=PREFIX) as client:
        await client.connect()

        async def once() -> None:
            replies = await client.stats(timeout=10)
            if len(replies) != 1:
                raise RuntimeError(f"stats: {len(replies)} replies from the one worker")

        return await _timed(samples, once)


async def _first_token(url: str, samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        async with Client(url, prefix=PREFIX) as client:  # fresh: no cached catalogue
            await client.connect()
            start = time.perf_counter()
            rid = await client.submit("Hello", model=MODEL, max_tokens=2, temperature=0.0)
            first: float | None = None
            async for event in client.stream(rid, timeout=60):
                if first is None and isinstance(event, DeltaEvent) and event.new_token_ids:
                    first = time.perf_counter() - start
            if first is None:
                raise RuntimeError(f"request {rid} ended without a token")
            times.append(first)
    return times


async def _scan_read(url: str, samples: int) -> list[float]:
    async with Client(url, prefix=PREFIX) as client:
        redis = await client.connect()

        async def once() -> None:
            names = [key async for key in redis.scan_iter(f"{PREFIX}:worker:*", 1000)]
            if names:
                await redis.mget(names)

        return await _timed(samples, once)


async def _rotation(urls: dict[str, str], samples: int, results: Samples) -> None:
    for server in SERVERS:
        url = urls[server]
        for measure, timed in (
            (STATS, _stats),
            (FIRST_TOKEN, _first_token),
            (SCAN_READ, _scan_read),
        ):
            for seconds in await timed(url, samples):
                results.add(measure, server, seconds)


async def _ready(url: str, worker: Worker) -> None:
    async with Client(url, prefix=PREFIX) as client:
        await wait_ready(client, [worker])
        await _first_token(url, 2)  # warm-up: the model's first steps, the script cache


def run_keyspace_bench(args: argparse.Namespace) -> int:
    results = Samples()
    with contextlib.ExitStack() as stack:
        servers = {
            name: stack.enter_context(RedisServer(extra_args=["--enable-debug-command", "yes"]))
            for name in SERVERS
        }
        urls = {name: server.url for name, server in servers.items()}
        with redis.Redis.from_url(urls[FILLED]) as filled:
            filled.execute_command("DEBUG", "POPULATE", args.keys, "other-app")
        tiny = Model(MODEL, MODEL, [], [])
        for name, url in urls.items():
            worker = start_worker(url, PREFIX, f"keyspace-{name}", [tiny], 4)
            stack.callback(stop_worker, worker.process)
            asyncio.run(_ready(url, worker))
        for _ in range(args.repeat):
            asyncio.run(_rotation(urls, args.samples, results))
        sizes = {name: _dbsize(url) for name, url in urls.items()}
    print(format_keyspace(results, sizes, args))
    return 0


def _dbsize(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return int(client.dbsize())


def format_keyspace(results: Samples, sizes: dict[str, int], args: argparse.Namespace) -> str:
    lines = [
        f"bench keyspace: one worker ({MODEL}) per private redis-server; keys: "
        f"{sizes[EMPTY]:,} (empty), {sizes[FILLED]:,} (filled); {args.repeat} rotations x "
        f"{args.samples} samples",
        f"{'':28} {'empty p50/p90 ms':>18} {'filled p50/p90 ms':>18} {'filled/empty':>13}",
    ]
    for measure in MEASURES:
        empty, filled = results.by[(measure, EMPTY)], results.by[(measure, FILLED)]
        ratio = statistics.median(filled) / statistics.median(empty)
        lines.append(f"{measure:28} {_p50_p90(empty):>18} {_p50_p90(filled):>18} {ratio:>12.2f}x")
    verdicts = []
    for measure in (STATS, FIRST_TOKEN):
        ratio = statistics.median(results.by[(measure, FILLED)]) / statistics.median(
            results.by[(measure, EMPTY)]
        )
        verdicts.append(f"{measure} {'within' if ratio <= GOAL else 'OVER'} {GOAL}x")
    lines.append("goal (issue 25): " + "; ".join(verdicts))
    return "\n".join(lines)


def _p50_p90(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.2f}/{pct(seconds, 0.9) * 1000:.2f}"
