"""Memory soak: thousands of requests through one worker daemon; does its memory settle?

    python -m tests.reliability.soak --requests 2000

Requests of varied prompts (distinct, 2-40 words), lengths (8-24 tokens), greedy and seeded
sampling, 16 in flight at a time, through the worker's whole path (Redis, consumer group,
engine, publisher). The worker's RSS (``/proc/PID/status``) and MLX's active and cache memory
(its ``stats`` control reply) are read at start, after the warm-up (the first quarter of the
requests, at least 200: the prefix cache is full and RSS on its plateau by then) and at the
end; growth after warm-up must stay under 5 %. At the end no per-request state may be left
(in-flight jobs, open publisher streams, engine requests).
"""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.local_redis import RedisServer
from tests.reliability.workers import worker_process
from tests.support.drivers import (
    DriverResult,
    config_from_arguments,
    exit_with,
    percentile,
    report,
    work_directory,
)
from tests.support.processes import WorkerProcess
from tests.support.prompts import random_prompts

MIB = 1024 * 1024


@dataclass
class SoakConfig:
    requests: int = 2000
    # Requests before the "after warm-up" reading: a quarter, at least 200, at most half. The
    # 64-entry prefix cache is full after ~70 distinct prompts, but RSS keeps climbing to its
    # plateau for a few hundred requests (allocator high-water marks of the largest batches).
    warm_up: float = 0.25
    min_warm_up: int = 200
    in_flight: int = 16
    seed: int = 11
    directory: Path | None = None


@dataclass
class Reading:
    at: str
    requests: int
    rss: int
    mlx_active: int
    mlx_cache: int


@dataclass
class SoakResult(DriverResult):
    readings: list[Reading] = field(default_factory=list)


async def _reading(client: Client, process: WorkerProcess, at: str, requests: int) -> Reading:
    replies = await client.stats(worker_id=process.worker_id, timeout=30)
    memory = (replies[0].result or {}).get("memory", {})
    return Reading(
        at=at,
        requests=requests,
        rss=process.rss(),
        mlx_active=int(memory.get("mlx_active_memory_bytes", 0)),
        mlx_cache=int(memory.get("mlx_cache_memory_bytes", 0)),
    )


async def _soak(config: SoakConfig, url: str, prefix: str, process: WorkerProcess) -> SoakResult:
    rng = random.Random(config.seed)
    prompts = random_prompts(config.requests, seed=config.seed, words=(2, 40))
    warm_at = min(
        max(int(config.requests * config.warm_up), config.min_warm_up), config.requests // 2
    )
    problems: list[str] = []
    readings: list[Reading] = []
    durations: list[float] = []
    trend: list[tuple[int, int]] = []  # (requests so far, RSS) at every tenth of the run
    tokens = 0
    async with Client(url, prefix=prefix, max_connections=4 * config.in_flight) as client:
        readings.append(await _reading(client, process, "at start", 0))
        slots = asyncio.Semaphore(config.in_flight)

        async def one(index: int) -> None:
            nonlocal tokens
            sampled = index % 2 == 1
            options: dict[str, Any] = {
                "max_tokens": rng.randint(8, 24),
                "temperature": 0.8 if sampled else 0.0,
            }
            if sampled:
                options["seed"] = index
            try:
                end = await client.generate(prompts[index], timeout=120, **options)
            finally:
                slots.release()
            if not isinstance(end, DoneEvent) or end.finish_reason not in ("length", "stop"):
                problems.append(f"request {index}: {end}")
                return
            tokens += end.usage.completion_tokens
            durations.append(end.usage.duration_ms / 1000)

        started = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        for index in range(config.requests):
            if index == warm_at:
                await asyncio.gather(*tasks)  # settle, then read
                readings.append(
                    await _reading(client, process, f"after warm-up ({index} requests)", index)
                )
            if index and index % max(1, config.requests // 10) == 0:
                trend.append((index, process.rss()))
            await slots.acquire()
            tasks.append(asyncio.create_task(one(index)))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        readings.append(await _reading(client, process, "at the end", config.requests))
        final = (await client.stats(worker_id=process.worker_id, timeout=30))[0].result or {}
    leftovers = {
        "in-flight jobs": len(final.get("jobs", {}).get("in_flight", [])),
        "open publisher streams": final.get("publisher", {}).get("open_streams", -1),
        "unsent events": final.get("publisher", {}).get("pending_events", -1),
        "engine requests": final.get("engine", {}).get("active_requests", -1),
    }
    problems += [f"{name} left at the end: {n}" for name, n in leftovers.items() if n != 0]
    return SoakResult(
        "Memory soak",
        readings=readings,
        problems=problems,
        values={
            "elapsed": elapsed,
            "tokens": tokens,
            "duration_p50": percentile(durations, 50),
            "duration_p99": percentile(durations, 99),
            "trend": trend,
        },
    )


def run_soak(config: SoakConfig) -> SoakResult:
    directory = work_directory(config.directory, "soak")
    with RedisServer(directory=directory / "redis") as server:
        process = worker_process("soak-1", server.url, "soak", directory, max_concurrency=8)
        try:
            process.start().wait_ready()
            result = asyncio.run(_soak(config, server.url, "soak", process))
            stop_code = process.stop()
        finally:
            process.kill()
    if stop_code != 0:
        result.problems.append(f"the worker did not stop cleanly (rc={stop_code})")
    _, warm, end = result.readings
    rss_growth = (end.rss - warm.rss) / warm.rss
    active_growth = (end.mlx_active - warm.mlx_active) / max(warm.mlx_active, 1)
    after = [rss for n, rss in result.values["trend"] if n > warm.requests] + [end.rss]
    result.values.update(rss_growth=rss_growth, active_growth=active_growth)
    values = result.values
    result.figures = [
        ("requests (greedy and seeded, 8-24 tokens, 16 in flight)", config.requests),
        ("tokens generated", values["tokens"]),
        (
            "wall time (s) / requests per second",
            f"{values['elapsed']:.0f} / {config.requests / values['elapsed']:.1f}",
        ),
        (
            "request run time p50 / p99 (s)",
            f"{values['duration_p50']:.2f} / {values['duration_p99']:.2f}",
        ),
        *(
            (
                f"RSS / MLX active / MLX cache {r.at} (MiB)",
                f"{r.rss / MIB:.1f} / {r.mlx_active / MIB:.1f} / {r.mlx_cache / MIB:.1f}",
            )
            for r in result.readings
        ),
        (
            "RSS at each tenth of the run (MiB)",
            " ".join(f"{rss / MIB:.0f}" for _, rss in values["trend"]),
        ),
        (
            "RSS band after warm-up, min - max (MiB)",
            f"{min(after) / MIB:.0f} - {max(after) / MIB:.0f}" if after else "-",
        ),
        ("RSS growth after warm-up", f"{rss_growth * 100:+.1f} %"),
        ("MLX active memory growth after warm-up", f"{active_growth * 100:+.1f} %"),
        ("per-request state left at the end", "none" if not result.problems else "SEE PROBLEMS"),
    ]
    result.values["directory"] = str(directory)
    return result


def main(argv: list[str] | None = None) -> int:
    config = config_from_arguments(SoakConfig(), __doc__, ("requests",), argv)
    result = run_soak(config)
    status = report(result, config)
    growth_ok = result.values["rss_growth"] < 0.05 and result.values["active_growth"] < 0.05
    return status if growth_ok else 1


if __name__ == "__main__":
    exit_with(main)
