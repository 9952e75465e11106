"""``mlx-worker bench models``: two models on one worker against one worker per model.

Two layouts serve the same two models from Redis under the same load: **shared**, one worker
process with both models (``--model A --model B``: an engine each, in one process), and
**separate**, two worker processes with one model each. Every run of a layout starts its
workers afresh under a fresh key prefix, warms them up, then submits ``--concurrency`` jobs per
model at once through the client library (each naming its model, greedy) and reads
every stream. Layouts alternate (A B A B …) so drift hits both alike.

Reported per model and in total: tokens per second delivered to subscribers (completion tokens
over the wall time from the submit to the model's last ``done``), TTFT and job latency p50 from
the submit, the ratio shared / separate (median of the per-rotation ratios), and each layout's
worker CPU seconds during the measured load and the workers' peak resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.identifiers import is_valid_id
from mlx_redis_protocol.messages import ErrorEvent, Event, Job
from mlx_redis_worker.bench.e2e_bench import Run, pct, process_cpu, ratio, through_redis
from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.bench.worker_process import Worker, stop_worker, wait_ready
from mlx_redis_worker.bench.worker_process import start_worker as start_process
from mlx_redis_worker.local_redis import local_redis
from mlx_redis_worker.models import load_model
from mlx_redis_worker.models.paths import FIXTURES

SHARED = "shared"  # one worker process serving both models
SEPARATE = "separate"  # one worker process per model
LAYOUTS = (SHARED, SEPARATE)
TOTAL = "total"
WARMUP_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Model:
    name: str  # the fleet's name: the job field ``model`` and the stream mlxw:jobs:{name}
    source: str  # fixture name, folder or hub id
    prompts: list[list[int]]
    warmup: list[list[int]]


@dataclass(slots=True)
class LayoutRun:
    """One run of one layout: a Run per model and the total, the workers' cost."""

    layout: str
    runs: dict[str, Run]  # by model name, plus TOTAL
    cpu_seconds: float | None  # the workers' user + system CPU during the measured load
    peak_rss_bytes: int | None  # the workers' peak resident memory (VmHWM), summed


@dataclass(slots=True)
class Results:
    models: list[Model]
    by_layout: dict[str, list[LayoutRun]] = field(
        default_factory=lambda: {layout: [] for layout in LAYOUTS}
    )


def _models(spec: str) -> list[tuple[str, str]]:
    """``(name, source)`` of each entry of ``--models``: ``[NAME=]SOURCE``, the name defaulting
    to the fixture name or the folder's (hub id's) last component, as ``mlx-worker run`` does.
    The same source twice gets a second name, so a model can be measured against itself."""
    pairs: list[tuple[str, str]] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, _, source = entry.rpartition("=")
        if not name:
            name = source if source in FIXTURES else Path(source.rstrip("/")).name
        taken = {n for n, _ in pairs}
        base, n = name, 2
        while name in taken:
            name, n = f"{base}-{n}", n + 1
        if not is_valid_id(name):
            raise SystemExit(f"--models: {name!r} is not a valid model name; give NAME=SOURCE")
        pairs.append((name, source))
    if len(pairs) != 2:
        raise SystemExit(f"--models names {len(pairs)} models; the bench compares two")
    return pairs


def _prepare(args: argparse.Namespace) -> list[Model]:
    """Each model's prompts, from its own tokenizer (so they are ordinary tokens of it)."""
    models: list[Model] = []
    for index, (name, source) in enumerate(_models(args.models)):
        tokenizer = load_model(source)[1]  # the weights are dropped at once
        models.append(
            Model(
                name,
                source,
                make_prompts(tokenizer, args.concurrency, args.prompt_tokens, seed=index),
                make_prompts(tokenizer, 2, args.prompt_tokens, seed=1000 + index),
            )
        )
    return models


def start_worker(
    url: str, prefix: str, worker_id: str, models: list[Model], concurrency: int
) -> Worker:
    """A worker process serving ``models`` (each under its fleet name)."""
    flags = [f"{m.name}={m.source}" for m in models]
    return start_process(url, prefix, worker_id, flags, concurrency)


class _ModelClient(Client):
    """A client whose every job names one model, over a shared connection: e2e_bench's load
    (``through_redis``) then runs per model."""

    def __init__(self, model: str, redis: RedisClient, prefix: str) -> None:
        super().__init__(prefix=prefix, redis=redis)
        self.model = model

        self.errors: list[ErrorEvent] = []  # what ended the jobs that failed, for the report

    async def submit_job(self, job: Job, *, blobs: Mapping[str, bytes] | None = None) -> str:
        return await super().submit_job(replace(job, model=self.model), blobs=blobs)

    def stream(
        self, request_id: str, *, timeout: float | None = None
    ) -> AsyncGenerator[Event, None]:
        return self._recording(super().stream(request_id, timeout=timeout))

    async def _recording(self, events: AsyncGenerator[Event, None]) -> AsyncGenerator[Event, None]:
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, ErrorEvent):
                    self.errors.append(event)
                yield event


async def _load(
    client: Client, models: list[Model], max_tokens: int, warmup: bool = False
) -> dict[str, Run]:
    """Every model's jobs submitted at once, every stream read to its end: a Run per model
    (its wall time ends at its last done) and the total."""
    prompts = {m.name: m.warmup if warmup else m.prompts for m in models}
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: _ModelClient(name, client.redis, client.keys.prefix) for name in prompts}
        for model_client in clients.values():
            await stack.enter_async_context(model_client)
        loads = await asyncio.gather(
            *(through_redis(c, prompts[name], max_tokens) for name, c in clients.items())
        )
    runs: dict[str, Run] = {}
    for (name, batch), (tokens, ttfts, latencies, seconds) in zip(
        prompts.items(), loads, strict=True
    ):
        if len(latencies) != len(batch):  # an error event ends a stream without a done
            said = "; ".join(f"{e.code}: {e.message}" for e in clients[name].errors[:3])
            raise RuntimeError(
                f"{name}: {len(batch) - len(latencies)} of {len(batch)} jobs failed ({said}); "
                "see the worker logs"
            )
        runs[name] = Run(name, len(batch), tokens, seconds, ttfts, latencies)
    every = list(runs.values())
    runs[TOTAL] = Run(
        TOTAL,
        sum(r.concurrency for r in every),
        sum(r.tokens for r in every),
        max(r.seconds for r in every),
        [t for r in every for t in r.ttfts],
        [t for r in every for t in r.latencies],
    )
    return runs


def _peak_rss(pid: int) -> int | None:
    """The process's peak resident memory in bytes (VmHWM, Linux); None where unreadable."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.partition(":")[::2] for line in status.splitlines())
        return int(fields["VmHWM"].split()[0]) * 1024  # reported in kB
    return None


def _total(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


async def _measure(
    url: str, prefix: str, layout: str, workers: list[Worker], results: Results, max_tokens: int
) -> LayoutRun:
    async with Client(url, prefix=prefix) as client:
        await wait_ready(client, workers)
        await _load(client, results.models, WARMUP_TOKENS, warmup=True)
        pids = [w.process.pid for w in workers]
        cpu_before = _total([process_cpu(pid) for pid in pids])
        runs = await _load(client, results.models, max_tokens)
        cpu_after = _total([process_cpu(pid) for pid in pids])
        rss = _total([_peak_rss(pid) for pid in pids])
    cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    return LayoutRun(layout, runs, cpu, int(rss) if rss is not None else None)


def _run_layout(url: str, layout: str, results: Results, args: argparse.Namespace) -> LayoutRun:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    if layout == SHARED:
        groups = [(f"{prefix}-shared", results.models)]
    else:
        groups = [(f"{prefix}-{m.name}", [m]) for m in results.models]
    with contextlib.ExitStack() as stack:
        workers: list[Worker] = []
        for worker_id, models in groups:
            worker = start_worker(url, prefix, worker_id, models, args.concurrency)
            stack.callback(stop_worker, worker.process)
            workers.append(worker)
        return asyncio.run(_measure(url, prefix, layout, workers, results, args.max_tokens))


def run_models_bench(args: argparse.Namespace) -> int:
    results = Results(_prepare(args))
    with local_redis(args.redis_url) as (url, what):
        print(f"Redis: {what}; worker logs: {tempfile.gettempdir()}/mlxw-bench*.log")
        for rotation in range(args.repeat):
            order = LAYOUTS if rotation % 2 == 0 else LAYOUTS[::-1]
            for layout in order:
                results.by_layout[layout].append(_run_layout(url, layout, results, args))
    print(format_models(results, args))
    return 0


def _p50(values: list[float]) -> float:
    return pct(values, 0.5) if values else float("nan")


def _cost(runs: list[LayoutRun]) -> str:
    cpu = [r.cpu_seconds for r in runs if r.cpu_seconds is not None]
    rss = [r.peak_rss_bytes for r in runs if r.peak_rss_bytes is not None]
    cpu_text = f"{statistics.median(cpu):.1f}" if len(cpu) == len(runs) else "-"
    rss_text = (
        f"{statistics.median([float(b) for b in rss]) / 2**20:.0f}"
        if len(rss) == len(runs)
        else "-"
    )
    return f"{cpu_text} | {rss_text}"


def _interpretation(total_ratio: float) -> str:
    import mlx.core as mx  # the device the workers run on (this process's default)

    cores = os.cpu_count() or 0
    if total_ratio > 1.05:
        verdict = f"one process serving both models delivered {total_ratio - 1:.0%} more"
    elif total_ratio < 0.95:
        verdict = f"one process per model delivered {1 / total_ratio - 1:.0%} more"
    else:
        verdict = "both layouts delivered about the same"
    return (
        f"Interpretation: {verdict} in total (shared / separate = {total_ratio:.2f}). Both "
        f"layouts run on the same {cores}-core machine (MLX device: {mx.default_device()}): "
        "the separate layout's two processes compete for the same cores (each with its own "
        "engine thread and BLAS threads), while the shared layout's two engine threads share "
        "one process and its interpreter lock. Neither is two machines' worth of compute."
    )


def format_models(results: Results, args: argparse.Namespace) -> str:
    names = [m.name for m in results.models]
    sources = ", ".join(f"{m.name} ({m.source})" for m in results.models)
    lines = [
        f"models {sources}; {args.concurrency} streams per model, prompt {args.prompt_tokens} "
        f"tokens, max_tokens {args.max_tokens}, {args.repeat} rotations (medians)",
        "| layout | model | jobs | tok/s | TTFT p50 (ms) | job latency p50 (ms) "
        "| worker CPU s | worker peak RSS (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in LAYOUTS:
        layout_runs = results.by_layout[layout]
        for name in [*names, TOTAL]:
            runs = [r.runs[name] for r in layout_runs]
            speed = statistics.median([r.tokens_per_second for r in runs])
            ttft = statistics.median([_p50(r.ttfts) for r in runs]) * 1e3
            latency = statistics.median([_p50(r.latencies) for r in runs]) * 1e3
            cost = _cost(layout_runs) if name == TOTAL else " | "
            lines.append(
                f"| {layout} | {name} | {runs[0].concurrency} | {speed:.1f} | {ttft:.0f} "
                f"| {latency:.0f} | {cost} |"
            )
    lines.append("")
    ratios: dict[str, float] = {}
    for name in [*names, TOTAL]:
        shared = [r.runs[name] for r in results.by_layout[SHARED]]
        separate = [r.runs[name] for r in results.by_layout[SEPARATE]]
        ratios[name] = ratio(shared, separate)
        lines.append(f"shared / separate tok/s, {name}: {ratios[name]:.2f}")
    lines.append("(median of per-rotation ratios; > 1: one process serving both is faster)")
    lines.append(_interpretation(ratios[TOTAL]))
    return "\n".join(lines)
