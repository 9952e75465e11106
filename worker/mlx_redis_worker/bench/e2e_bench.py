"""``mlx-worker bench e2e``: the whole system against the engine alone, same load, one run.

A worker process serves the model from Redis; this process submits N jobs at once through the
client library and reads every stream. Reported beside the same load run directly on our
``EngineCore`` (async path) and on raw mlx-lm ``BatchGenerator`` in this process: tokens per
second delivered to subscribers, TTFT and job latency (average, p50, p99, from the moment the
jobs are submitted), and the worker's Redis round trips per engine step.

``--cluster`` adds a private 3-master Redis Cluster with a second worker process of its own:
every rotation then runs end to end on both topologies, and the report compares them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from redis.asyncio.cluster import RedisCluster

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent
from mlx_redis_worker.bench.engine_bench import (
    PathResult,
    make_prompts,
    run_batch_generator,
    run_engine_async,
)
from mlx_redis_worker.bench.worker_process import Worker, start_worker, stop_worker, wait_ready
from mlx_redis_worker.engine import EngineConfig, EngineCore, SchedulerConfig
from mlx_redis_worker.local_redis import LocalCluster, local_redis
from mlx_redis_worker.models import load_model

SINGLE = "single Redis"
CLUSTER = "Redis Cluster (3 masters)"
CLUSTER_GOAL = 0.9  # cluster end to end / single-node end to end, both against the engine alone
RAW_GOAL = 0.95  # end to end / raw mlx-lm BatchGenerator in this process (issue 28)


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


@dataclass(slots=True)
class Topology:
    """One Redis deployment and the worker process that serves the model from it."""

    name: str  # SINGLE or CLUSTER
    path: str  # the table's path name
    url: str
    prefix: str
    worker: Worker
    redis_pids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Level:
    """Every rotation's runs of one concurrency, by path."""

    concurrency: int
    e2e: dict[str, list[Run]]  # by topology name, in the order the topologies were started
    engine: list[Run] = field(default_factory=list)
    raw: list[Run] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def through_redis(
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


def process_cpu(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc (Linux); None where there is none."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(after_name[11]) + int(after_name[12])) / os.sysconf("SC_CLK_TCK")


def cpu_of(pids: dict[str, list[int]]) -> dict[str, float | None]:
    """CPU seconds of each named group of processes (summed); None where one is unreadable."""
    cpu: dict[str, float | None] = {}
    for name, group in pids.items():
        known = [s for s in (process_cpu(pid) for pid in group) if s is not None]
        cpu[name] = sum(known) if group and len(known) == len(group) else None
    return cpu


async def redis_pids(url: str, prefix: str) -> list[int]:
    """The Redis server processes behind ``url`` (every node of a Cluster), from INFO."""
    async with Client(url, prefix=prefix) as client:
        redis = client.redis
        if isinstance(redis, RedisCluster):
            per_node = await redis.info("server", target_nodes=RedisCluster.ALL_NODES)
            return [int(info["process_id"]) for info in per_node.values()]
        return [int((await redis.info("server"))["process_id"])]


def run_e2e(topology: Topology, prompts: list[list[int]], max_tokens: int) -> Run:
    async def scenario() -> Run:
        pids = {
            "worker": [topology.worker.process.pid],
            "Redis": topology.redis_pids,
            "client": [os.getpid()],
        }
        async with Client(topology.url, prefix=topology.prefix) as client:
            steps_before, trips_before = await _worker_counters(client)
            cpu_before = cpu_of(pids)
            tokens, ttfts, latencies, seconds = await through_redis(client, prompts, max_tokens)
            cpu_after = cpu_of(pids)
            steps_after, trips_after = await _worker_counters(client)
        steps = steps_after - steps_before
        cpu = {
            name: (after - before) / tokens * 1e6
            for name, before in cpu_before.items()
            if before is not None and (after := cpu_after[name]) is not None and tokens
        }
        return Run(
            topology.path,
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


def run_raw(
    model: object,
    tokenizer: object,
    prompts: list[list[int]],
    max_tokens: int,
    config: SchedulerConfig,
) -> Run:
    """Raw mlx-lm ``BatchGenerator`` in this process, with this process's CPU per token: the
    floor that the end-to-end path's worker + Redis + client CPU per token is read against."""
    before = process_cpu(os.getpid())
    run = _from_path(run_batch_generator(model, tokenizer, prompts, max_tokens, config))
    after = process_cpu(os.getpid())
    if before is not None and after is not None and run.tokens:
        run.cpu_per_token = {"raw BatchGenerator": (after - before) / run.tokens * 1e6}
    return run


async def _serving(topology: Topology) -> None:
    async with Client(topology.url, prefix=topology.prefix) as client:
        await wait_ready(client, [topology.worker])


def _start_topologies(
    args: argparse.Namespace, stack: contextlib.ExitStack[bool | None]
) -> list[Topology]:
    """The single-node Redis (and with ``--cluster`` a private Cluster), each with a worker
    process of its own; ``stack`` stops the workers, then the servers."""
    url, what = stack.enter_context(local_redis(args.redis_url or os.environ.get("MLXW_REDIS_URL")))
    servers = [(SINGLE, url, what)]
    if args.cluster:
        cluster = stack.enter_context(LocalCluster(masters=3))
        ports = ", ".join(str(node.port) for node in cluster.nodes)
        servers.append((CLUSTER, cluster.url, f"a private 3-master Cluster on ports {ports}"))
    topologies: list[Topology] = []
    for name, url, what in servers:
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        worker = start_worker(url, prefix, f"bench-{prefix}", [args.model], max(args.levels))
        stack.callback(stop_worker, worker.process)
        print(f"{'Redis' if name == SINGLE else name}: {what}; worker log: {worker.log_path}")
        path = f"end to end, {name}" if args.cluster else "end to end (Redis + worker + client)"
        topologies.append(Topology(name, path, url, prefix, worker))
    for topology in topologies:  # the workers load the model meanwhile
        asyncio.run(_serving(topology))
        topology.redis_pids = asyncio.run(redis_pids(topology.url, topology.prefix))
    return topologies


def run_e2e_bench(args: argparse.Namespace) -> int:
    args.levels = [int(c) for c in str(args.concurrency).split(",")]
    model, tokenizer = load_model(args.model)
    config = SchedulerConfig(max_num_seqs=max(args.levels), enable_prefix_cache=False)
    engine = EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))
    levels: list[Level] = []
    with contextlib.ExitStack() as stack:
        stack.callback(engine.close)
        topologies = _start_topologies(args, stack)
        warmup = make_prompts(tokenizer, 2, args.prompt_tokens, seed=999)
        for topology in topologies:
            run_e2e(topology, warmup, 8)
        run_engine_async(engine, warmup, 8)
        for concurrency in args.levels:
            prompts = make_prompts(tokenizer, concurrency, args.prompt_tokens, seed=concurrency)
            level = Level(concurrency, {t.name: [] for t in topologies})
            for rotation in range(args.repeat):  # rotate: drift hits every path alike
                # Alternate which topology goes first, so neither always follows the raw path.
                shift = rotation % len(topologies)
                for topology in topologies[shift:] + topologies[:shift]:
                    level.e2e[topology.name].append(run_e2e(topology, prompts, args.max_tokens))
                level.engine.append(_from_path(run_engine_async(engine, prompts, args.max_tokens)))
                level.raw.append(run_raw(model, tokenizer, prompts, args.max_tokens, config))
            levels.append(level)
    print(format_e2e(levels, args))
    return 0


def _triple(values: list[float]) -> tuple[float, float, float]:
    """Average, p50 and p99 of one run's values."""
    return statistics.fmean(values), pct(values, 0.5), pct(values, 0.99)


def _median_triple(triples: list[tuple[float, float, float]]) -> str:
    return " / ".join(f"{statistics.median(t[i] for t in triples) * 1e3:.0f}" for i in range(3))


def ratio(a: list[Run], b: list[Run]) -> float:
    """Median over rotations of a's tok/s over b's in the same rotation."""
    return statistics.median(
        x.tokens_per_second / y.tokens_per_second for x, y in zip(a, b, strict=True)
    )


def _row(repeats: list[Run]) -> str:
    first = repeats[0]
    speed = statistics.median(r.tokens_per_second for r in repeats)
    ttft = _median_triple([_triple(r.ttfts) for r in repeats])
    latency = _median_triple([_triple(r.latencies) for r in repeats]) if first.latencies else "-"
    return (
        f"| {first.concurrency} | {first.path} | {speed:.1f} | {ttft} | {latency} "
        f"| {_per_step(repeats)} |"
    )


def _per_step(repeats: list[Run]) -> str:
    trips = [r.round_trips_per_step for r in repeats if r.round_trips_per_step is not None]
    return f"{statistics.median(trips):.2f}" if trips else "-"


def _cpu_line(repeats: list[Run]) -> str | None:
    shares = [r.cpu_per_token for r in repeats if r.cpu_per_token]
    if not shares:
        return None
    return "CPU µs per delivered token: " + ", ".join(
        f"{name} {statistics.median(s[name] for s in shares):.0f}" for name in shares[0]
    )


def _summary(level: Level) -> list[str]:
    """The ratios of one concurrency: one topology as the bench always printed them; two
    side by side, and the Cluster against the single node."""
    engine_vs_raw = f"engine / raw BatchGenerator = {ratio(level.engine, level.raw):.3f}"
    raw_cpu = _cpu_line(level.raw)
    if len(level.e2e) == 1:
        (e2e,) = level.e2e.values()
        cpu = _cpu_line(e2e)
        return [
            f"concurrency {level.concurrency}: end-to-end / engine alone tok/s = "
            f"{ratio(e2e, level.engine):.3f}; {engine_vs_raw}",
            f"  {_against_raw(e2e, level.raw)}",
            *([f"  end to end, {cpu}"] if cpu else []),
            *([f"  raw, {raw_cpu}"] if raw_cpu else []),
        ]
    lines = [f"concurrency {level.concurrency}: {engine_vs_raw}"]
    for name, e2e in level.e2e.items():
        cpu = _cpu_line(e2e)
        lines.append(
            f"  {name}: end-to-end / engine alone tok/s = {ratio(e2e, level.engine):.3f}, "
            f"{_against_raw(e2e, level.raw)}, "
            f"round trips / step {_per_step(e2e)}" + (f"; {cpu}" if cpu else "")
        )
    if raw_cpu:
        lines.append(f"  raw, {raw_cpu}")
    single, cluster = level.e2e[SINGLE], level.e2e[CLUSTER]
    versus = ratio(cluster, single)
    lines.append(
        f"  cluster / single = {versus:.2f} (goal ≥ {CLUSTER_GOAL:.2f}: "
        f"{'met' if versus >= CLUSTER_GOAL else 'MISSED'}; end-to-end tok/s, median of "
        "per-rotation ratios)"
    )
    return lines


def _against_raw(e2e: list[Run], raw: list[Run]) -> str:
    versus = ratio(e2e, raw)
    return (
        f"end-to-end / raw BatchGenerator tok/s = {versus:.3f} (goal ≥ {RAW_GOAL:.2f}: "
        f"{'met' if versus >= RAW_GOAL else 'MISSED'})"
    )


def format_e2e(levels: list[Level], args: argparse.Namespace) -> str:
    lines = [
        f"model {args.model}, prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, "
        f"{args.repeat} rotations (medians)",
        "| concurrency | path | tok/s | TTFT avg / p50 / p99 (ms) "
        "| job latency avg / p50 / p99 (ms) | round trips / step |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for level in levels:
        lines.extend(_row(repeats) for repeats in [*level.e2e.values(), level.engine, level.raw])
    lines.append("")
    for level in levels:
        lines.extend(_summary(level))
    return "\n".join(lines)
