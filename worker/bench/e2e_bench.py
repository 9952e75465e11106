"""``mlx-worker bench e2e``: the whole system against the engine alone, same load, one run.

A worker process serves the model from Redis; this process submits N jobs at once through the
client library and reads every stream. Reported beside the same load run directly on our
``EngineCore`` (async path) and on raw mlx-lm ``BatchGenerator`` in this process: tokens per
second delivered to subscribers, TTFT and job latency (average, p50, p99, from the moment the
jobs are submitted), and the worker's Redis round trips per engine step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from protocol.client import Client
from protocol.messages import DeltaEvent, DoneEvent
from worker.bench.engine_bench import (
    PathResult,
    make_prompts,
    run_batch_generator,
    run_engine_async,
)
from worker.engine import EngineConfig, EngineCore, SchedulerConfig
from worker.local_redis import local_redis
from worker.models import load_model


@dataclass(slots=True)
class Run:
    path: str
    concurrency: int
    tokens: int
    seconds: float
    ttfts: list[float]
    latencies: list[float]
    round_trips_per_step: float | None = None
    # CPU µs per delivered token of each process (user + system), where /proc tells.
    cpu_per_token: dict[str, float] | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _through_redis(
    client: Client, prompts: list[list[int]], max_tokens: int
) -> tuple[int, list[float], list[float], float]:
    start = time.perf_counter()
    ids = await asyncio.gather(
        *(
            client.submit(prompt_token_ids=p, max_tokens=max_tokens, temperature=0.0)
            for p in prompts
        )
    )
    ttfts: list[float] = []
    latencies: list[float] = []
    tokens = 0

    async def follow(request_id: str) -> None:
        nonlocal tokens
        first = True
        async for event in client.stream(request_id, timeout=300):
            if isinstance(event, DeltaEvent) and event.new_token_ids:
                if first:
                    ttfts.append(time.perf_counter() - start)
                    first = False
                tokens += len(event.new_token_ids)
            elif isinstance(event, DoneEvent):
                latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(follow(rid) for rid in ids))
    return tokens, ttfts, latencies, time.perf_counter() - start


async def _worker_counters(client: Client) -> tuple[int, int]:
    replies = await client.stats(timeout=10)
    publisher = (replies[0].result or {}).get("publisher", {})
    return int(publisher.get("steps", 0)), int(publisher.get("round_trips", 0))


def _process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc (Linux); None where there is none."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_of(pids: dict[str, int]) -> dict[str, float | None]:
    return {name: _process_cpu(pid) for name, pid in pids.items()}


def run_e2e(
    url: str, prefix: str, prompts: list[list[int]], max_tokens: int, worker_pid: int
) -> Run:
    async def scenario() -> Run:
        async with Client(url, prefix=prefix) as client:
            server = await client.redis.info("server")
            pids = {"worker": worker_pid, "Redis": int(server["process_id"]), "client": os.getpid()}
            steps_before, trips_before = await _worker_counters(client)
            cpu_before = _cpu_of(pids)
            tokens, ttfts, latencies, seconds = await _through_redis(client, prompts, max_tokens)
            cpu_after = _cpu_of(pids)
            steps_after, trips_after = await _worker_counters(client)
        steps = steps_after - steps_before
        cpu = {
            name: (after - before) / tokens * 1e6
            for name, before in cpu_before.items()
            if before is not None and (after := cpu_after[name]) is not None and tokens
        }
        return Run(
            "end to end (Redis + worker + client)",
            len(prompts),
            tokens,
            seconds,
            ttfts,
            latencies,
            (trips_after - trips_before) / steps if steps else None,
            cpu or None,
        )

    return asyncio.run(scenario())


def _from_path(result: PathResult) -> Run:
    return Run(result.path, result.concurrency, result.tokens, result.seconds, result.ttfts, [])


def _start_worker(
    url: str, prefix: str, args: argparse.Namespace, log_path: str
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "worker.cli",
        "--log-level",
        "WARNING",
        "run",
        "--model",
        args.model,
        "--redis-url",
        url,
        "--prefix",
        prefix,
        "--worker-id",
        f"bench-{prefix}",
        "--max-concurrency",
        str(max(args.levels)),
    ]
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


async def _wait_ready(url: str, prefix: str, process: subprocess.Popen[bytes]) -> None:
    async with Client(url, prefix=prefix) as client:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError("the worker exited during start-up")
            try:
                if await client.ping(timeout=1):
                    return
            except Exception:  # not up yet
                await asyncio.sleep(0.5)
        raise RuntimeError("the worker did not answer ping within 180 s")


def run_e2e_bench(args: argparse.Namespace) -> int:
    args.levels = [int(c) for c in str(args.concurrency).split(",")]
    model, tokenizer = load_model(args.model)
    config = SchedulerConfig(max_num_seqs=max(args.levels), enable_prefix_cache=False)
    engine = EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    log_path = os.path.join(tempfile.gettempdir(), f"mlxw-{prefix}.log")
    runs: list[list[Run]] = []
    with local_redis(args.redis_url or os.environ.get("MLXW_REDIS_URL")) as (url, what):
        print(f"Redis: {what}; worker log: {log_path}")
        process = _start_worker(url, prefix, args, log_path)
        try:
            asyncio.run(_wait_ready(url, prefix, process))
            warmup = make_prompts(tokenizer, 2, args.prompt_tokens, seed=999)
            run_e2e(url, prefix, warmup, 8, process.pid)
            run_engine_async(engine, warmup, 8)
            for level in args.levels:
                prompts = make_prompts(tokenizer, level, args.prompt_tokens, seed=level)
                level_runs: list[list[Run]] = [[], [], []]
                for _ in range(args.repeat):  # rotate: drift hits every path alike
                    level_runs[0].append(
                        run_e2e(url, prefix, prompts, args.max_tokens, process.pid)
                    )
                    level_runs[1].append(
                        _from_path(run_engine_async(engine, prompts, args.max_tokens))
                    )
                    level_runs[2].append(
                        _from_path(
                            run_batch_generator(model, tokenizer, prompts, args.max_tokens, config)
                        )
                    )
                runs.extend(level_runs)
        finally:
            process.terminate()
            process.wait(timeout=60)
            engine.close()
    print(format_e2e(runs, args))
    return 0


def _triple(values: list[float]) -> tuple[float, float, float]:
    """Average, p50 and p99 of one run's values."""
    return statistics.fmean(values), _pct(values, 0.5), _pct(values, 0.99)


def _median_triple(triples: list[tuple[float, float, float]]) -> str:
    return " / ".join(f"{statistics.median(t[i] for t in triples) * 1e3:.0f}" for i in range(3))


def format_e2e(runs: list[list[Run]], args: argparse.Namespace) -> str:
    lines = [
        f"model {args.model}, prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
        f"{args.repeat} rotations (medians)",
        "| concurrency | path | tok/s | TTFT avg / p50 / p99 (ms) "
        "| job latency avg / p50 / p99 (ms) | round trips / step |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for repeats in runs:
        first = repeats[0]
        speed = statistics.median(r.tokens_per_second for r in repeats)
        ttft = _median_triple([_triple(r.ttfts) for r in repeats])
        latency = (
            _median_triple([_triple(r.latencies) for r in repeats]) if first.latencies else "-"
        )
        trips = [r.round_trips_per_step for r in repeats if r.round_trips_per_step is not None]
        per_step = f"{statistics.median(trips):.2f}" if trips else "-"
        lines.append(
            f"| {first.concurrency} | {first.path} | {speed:.1f} | {ttft} | {latency} "
            f"| {per_step} |"
        )
    lines.append("")
    for e2e, engine, raw in zip(runs[0::3], runs[1::3], runs[2::3], strict=True):

        def ratio(a: list[Run], b: list[Run]) -> float:
            return statistics.median(
                x.tokens_per_second / y.tokens_per_second for x, y in zip(a, b, strict=True)
            )

        lines.append(
            f"concurrency {e2e[0].concurrency}: end-to-end / engine alone tok/s = "
            f"{ratio(e2e, engine):.3f}; engine / raw BatchGenerator = {ratio(engine, raw):.3f}"
        )
        shares = [r.cpu_per_token for r in e2e if r.cpu_per_token]
        if shares:
            lines.append(
                "  end to end, CPU µs per delivered token: "
                + ", ".join(
                    f"{name} {statistics.median(s[name] for s in shares):.0f}" for name in shares[0]
                )
            )
    return "\n".join(lines)
