"""``mlx-worker bench fairness``: three tenants on one fleet, fair share on against FIFO.

One worker (``--slots`` slots) serves the model from Redis. Three tenants share it: **bulk**
queues ``--bulk-jobs`` long jobs at once, **steady** queues one medium job every
``--steady-every`` seconds, **interactive** one short job every ``--interactive-every``
seconds (priority -10). The same load (greedy, the same prompts, so the same tokens) runs
with the worker in order (FIFO, fair share off) and with ``--fair-share``, alternating
(FIFO, fair, FIFO, fair …) so drift hits both alike; each run starts a fresh worker under a
fresh key prefix and warms it up.

Reported per mode and tenant: TTFT p50 and p99 from the submit, tokens served; and the
total tokens per second (all tenants' completion tokens over the wall time from the first
submit to the last ``done``), with the ratio fair / FIFO (median of the per-rotation
ratios), which should stay at or above ``GOAL``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent
from mlx_redis_worker.bench.e2e_bench import pct
from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.bench.worker_process import start_worker, stop_worker, wait_ready
from mlx_redis_worker.local_redis import local_redis
from mlx_redis_worker.models import load_model

FIFO = "FIFO"
FAIR = "fair share"
MODES = (FIFO, FAIR)
TENANTS = ("bulk", "steady", "interactive")
GOAL = 0.95  # total tok/s with fair share / FIFO


@dataclass(frozen=True, slots=True)
class Plan:
    """Each tenant's jobs: (seconds after the start, prompt, max_tokens, priority)."""

    jobs: dict[str, list[tuple[float, list[int], int, int]]]
    warmup: list[list[int]]


@dataclass(slots=True)
class ModeRun:
    mode: str
    ttfts: dict[str, list[float]] = field(default_factory=dict)  # seconds, by tenant
    tokens: dict[str, int] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return sum(self.tokens.values()) / self.seconds


def _plan(args: argparse.Namespace) -> Plan:
    tokenizer = load_model(args.model)[1]
    count = args.bulk_jobs + args.steady_jobs + args.interactive_jobs
    prompts = iter(make_prompts(tokenizer, count, args.prompt_tokens, seed=29))
    jobs: dict[str, list[tuple[float, list[int], int, int]]] = {
        "bulk": [(0.0, next(prompts), args.bulk_tokens, 0) for _ in range(args.bulk_jobs)],
        "steady": [
            (0.5 + i * args.steady_every, next(prompts), args.steady_tokens, 0)
            for i in range(args.steady_jobs)
        ],
        "interactive": [
            (1.0 + i * args.interactive_every, next(prompts), args.interactive_tokens, -10)
            for i in range(args.interactive_jobs)
        ],
    }
    return Plan(jobs, make_prompts(tokenizer, 2, args.prompt_tokens, seed=290))


async def _one_job(
    client: Client, prompt: list[int], max_tokens: int, tenant: str, priority: int
) -> tuple[float | None, int]:
    """Submit and follow one job: its TTFT (seconds from the submit; None when it generated
    no token) and its tokens."""
    submitted = time.perf_counter()
    rid = await client.submit(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        tenant=tenant,
        priority=priority,
    )
    first: float | None = None
    tokens = 0
    async with contextlib.aclosing(client.stream(rid)) as events:
        async for event in events:
            if isinstance(event, DeltaEvent) and first is None and event.new_token_ids:
                first = time.perf_counter() - submitted
            elif isinstance(event, DoneEvent):
                tokens = event.usage.completion_tokens
    return first, tokens


async def _load(client: Client, plan: Plan, mode: str) -> ModeRun:
    start = time.perf_counter()

    async def at(
        delay: float, prompt: list[int], tokens: int, tenant: str, priority: int
    ) -> tuple[str, tuple[float | None, int]]:
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        return tenant, await _one_job(client, prompt, tokens, tenant, priority)

    results = await asyncio.gather(
        *(
            at(delay, prompt, tokens, tenant, priority)
            for tenant, jobs in plan.jobs.items()
            for delay, prompt, tokens, priority in jobs
        )
    )
    run = ModeRun(mode, seconds=time.perf_counter() - start)
    for tenant, (ttft, tokens) in results:
        if ttft is not None:
            run.ttfts.setdefault(tenant, []).append(ttft)
        run.tokens[tenant] = run.tokens.get(tenant, 0) + tokens
        run.jobs[tenant] = run.jobs.get(tenant, 0) + 1
    return run


def _run_mode(url: str, mode: str, plan: Plan, args: argparse.Namespace) -> ModeRun:
    prefix = f"benchfair{uuid.uuid4().hex[:8]}"
    fair = "--fair-share" if mode == FAIR else "--no-fair-share"  # whatever the default
    worker = start_worker(url, prefix, f"{prefix}-w", [args.model], args.slots, fair)
    try:

        async def main() -> ModeRun:
            async with Client(url, prefix=prefix) as client:
                await wait_ready(client, [worker])
                await asyncio.gather(*(_one_job(client, p, 8, "warmup", 0) for p in plan.warmup))
                return await _load(client, plan, mode)

        return asyncio.run(main())
    finally:
        stop_worker(worker.process)


def run_fairness_bench(args: argparse.Namespace) -> int:
    plan = _plan(args)
    runs: dict[str, list[ModeRun]] = {mode: [] for mode in MODES}
    with local_redis(args.redis_url) as (url, what):
        print(f"Redis: {what}; worker logs: {tempfile.gettempdir()}/mlxw-benchfair*.log")
        for _ in range(args.repeat):
            for mode in MODES:
                runs[mode].append(_run_mode(url, mode, plan, args))
    print(format_fairness(runs, args))
    return 0


def _ms(values: list[float], q: float) -> str:
    return f"{pct(values, q) * 1e3:.0f}" if values else "-"


def format_fairness(runs: dict[str, list[ModeRun]], args: argparse.Namespace) -> str:
    lines = [
        f"model {args.model}, {args.slots} slots; bulk {args.bulk_jobs} x {args.bulk_tokens} "
        f"tokens at once; steady {args.steady_jobs} x {args.steady_tokens} tokens every "
        f"{args.steady_every} s; interactive {args.interactive_jobs} x "
        f"{args.interactive_tokens} tokens every {args.interactive_every} s (priority -10); "
        f"{args.repeat} rotations (TTFT over all rotations' jobs; tok/s medians)",
        "| mode | tenant | jobs | TTFT p50 (ms) | TTFT p99 (ms) | tokens served |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        for tenant in TENANTS:
            ttfts = [t for run in runs[mode] for t in run.ttfts.get(tenant, [])]
            tokens = statistics.median([run.tokens.get(tenant, 0) for run in runs[mode]])
            jobs = runs[mode][0].jobs.get(tenant, 0)
            lines.append(
                f"| {mode} | {tenant} | {jobs} | {_ms(ttfts, 0.5)} | {_ms(ttfts, 0.99)} "
                f"| {tokens:.0f} |"
            )
        speed = statistics.median([run.tokens_per_second for run in runs[mode]])
        lines.append(f"| {mode} | **total tok/s** | | | | {speed:.1f} |")
    lines.append("")
    ratio = statistics.median(
        fair.tokens_per_second / fifo.tokens_per_second
        for fair, fifo in zip(runs[FAIR], runs[FIFO], strict=True)
    )
    verdict = "meets" if ratio >= GOAL else "misses"
    lines.append(f"total tok/s, fair share / FIFO: {ratio:.2f} ({verdict} the goal >= {GOAL})")
    return "\n".join(lines)
