"""``mlx-worker bench prefix``: time to first token with a shared system prompt, cold and warm.

Every request is a long system prompt (``--system-tokens``) followed by its own short question
(``--user-tokens``), sent one at a time so a TTFT is that request's prefill alone. Paths, each on
a fresh engine over the same model:

- **no prefix cache**: every request prefills everything (the baseline the ratios use);
- **cold**: the first request of each system prompt on an engine with the cache on (a miss);
- **warm, prefix_boundary**: the following requests, which declare the system prompt as their
  shared prefix, so the engine keeps one compact entry for it;
- **warm, whole sequences**: the same without ``prefix_boundary``: the engine keeps each
  finished sequence and a new request reuses a trimmed copy of one;
- **restored**: the boundary engine's cache saved to disk, then a new process loads the model
  and the cache and serves new questions on the same system prompts.

Greedy outputs of every cached path are compared with the uncached ones for the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.engine import EngineConfig, EngineCore, SamplingParams, SchedulerConfig
from mlx_redis_worker.models import load_model

WARMUP_SEED = 10_000


@dataclass(slots=True)
class Timed:
    """One request: its prompt's place in the workload, TTFT, and what it produced."""

    round: int
    question: int
    ttft: float
    cached_tokens: int
    output_token_ids: list[int]


@dataclass(slots=True)
class Workload:
    systems: list[list[int]]
    questions: list[list[list[int]]]  # per round

    @classmethod
    def build(cls, tokenizer: Any, args: argparse.Namespace, question_seed: int) -> Workload:
        systems = [
            make_prompts(tokenizer, 1, args.system_tokens, seed=r)[0] for r in range(args.rounds)
        ]
        questions = [
            make_prompts(tokenizer, args.requests, args.user_tokens, seed=question_seed + r)
            for r in range(args.rounds)
        ]
        return cls(systems, questions)

    def prompts(self) -> list[tuple[int, int, list[int]]]:
        return [
            (r, q, system + question)
            for r, system in enumerate(self.systems)
            for q, question in enumerate(self.questions[r])
        ]


def serve(
    model: Any,
    tokenizer: Any,
    args: argparse.Namespace,
    workload: Workload,
    *,
    cache: bool,
    boundary: bool,
    load_from: str | None = None,
    save_to: str | None = None,
) -> tuple[list[Timed], dict[str, Any]]:
    """Run the workload one request at a time on a fresh engine; return timings and facts."""
    config = SchedulerConfig(enable_prefix_cache=cache, max_num_seqs=4)
    engine = EngineCore(
        model, tokenizer, EngineConfig(model_name=args.model, scheduler_config=config)
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    facts: dict[str, Any] = {}

    async def one(prompt: list[int], shared: int) -> tuple[float, int, list[int]]:
        start = time.perf_counter()
        rid = await engine.add_request(prompt, params, prefix_boundary=shared)
        ttft = 0.0
        outputs = []
        async for output in engine.stream_outputs(rid):
            if not ttft and output.new_token_ids:
                ttft = time.perf_counter() - start
            outputs.append(output)
        return ttft, outputs[-1].cached_tokens, outputs[-1].output_token_ids

    async def scenario() -> list[Timed]:
        # Compile and warm the shapes on a prompt that shares nothing with the workload.
        warm = make_prompts(tokenizer, 1, args.system_tokens + args.user_tokens, WARMUP_SEED)[0]
        await one(warm, 0)
        engine.clear_prefix_cache()
        if load_from is not None:
            started = time.perf_counter()
            facts["loaded_entries"] = engine.load_cache_from_disk(load_from)
            facts["load_seconds"] = time.perf_counter() - started
        timed = []
        for r, q, prompt in workload.prompts():
            shared = args.system_tokens if boundary else 0
            ttft, cached, ids = await one(prompt, shared)
            timed.append(Timed(r, q, ttft, cached, ids))
        await engine.stop()
        return timed

    try:
        timed = asyncio.run(scenario())
        stats = engine.cache_stats()
        if stats is not None:
            facts["entries"], facts["memory_bytes"] = stats.entries, stats.memory_bytes
        if save_to is not None:
            started = time.perf_counter()
            assert engine.save_cache_to_disk(save_to), "saving the prefix cache failed"
            facts["save_seconds"] = time.perf_counter() - started
            facts["disk_bytes"] = sum(p.stat().st_size for p in Path(save_to).iterdir())
    finally:
        engine.close()
    return timed, facts


def run_prefix_bench(args: argparse.Namespace) -> int:
    if args.restored_from:
        return _serve_restored(args)
    model, tokenizer = load_model(args.model)
    workload = Workload.build(tokenizer, args, question_seed=100)
    print(_describe(args))
    cache_dir = tempfile.mkdtemp(prefix="mlxw-prefix-bench-")
    try:
        uncached, _ = serve(model, tokenizer, args, workload, cache=False, boundary=False)
        by_boundary, boundary_facts = serve(
            model, tokenizer, args, workload, cache=True, boundary=True, save_to=cache_dir
        )
        whole, whole_facts = serve(model, tokenizer, args, workload, cache=True, boundary=False)
        restarted = time.perf_counter()
        restored, restored_facts = _restart_and_serve(args, cache_dir)
        restored_facts["restart_seconds"] = time.perf_counter() - restarted
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    rows = [
        ("no prefix cache", uncached),
        ("cold (first request per system prompt)", [t for t in by_boundary if t.question == 0]),
        ("warm, prefix_boundary", [t for t in by_boundary if t.question > 0]),
        ("warm, whole sequences", [t for t in whole if t.question > 0]),
        ("after save -> restart -> load", restored),
    ]
    reference = {(t.round, t.question): t.output_token_ids for t in uncached}
    restored_reference = _uncached_for(model, tokenizer, args)
    print(format_rows(rows, baseline=_p50(uncached)))
    print()
    print(
        f"Prefix cache after {len(by_boundary)} requests: with prefix_boundary "
        f"{boundary_facts['entries']} entries, {boundary_facts['memory_bytes'] / 2**20:.1f} MiB; "
        f"whole sequences {whole_facts['entries']} entries, "
        f"{whole_facts['memory_bytes'] / 2**20:.1f} MiB."
    )
    print(
        f"Save: {boundary_facts['save_seconds'] * 1e3:.0f} ms, "
        f"{boundary_facts['disk_bytes'] / 2**20:.1f} MiB on disk. Restart (new process: import, "
        f"model load, cache load, requests): {restored_facts['restart_seconds']:.1f} s, of which "
        f"cache load {restored_facts['load_seconds'] * 1e3:.0f} ms "
        f"({restored_facts['loaded_entries']} entries)."
    )
    same = _same_outputs(by_boundary, reference) + _same_outputs(whole, reference)
    same_restored = _same_outputs(restored, restored_reference)
    total = len(by_boundary) + len(whole)
    print(
        f"Greedy outputs equal to the uncached engine's: {same}/{total} in-process, "
        f"{same_restored}/{len(restored)} after restart."
    )
    return 0


def _restart_and_serve(
    args: argparse.Namespace, cache_dir: str
) -> tuple[list[Timed], dict[str, Any]]:
    command = [
        sys.executable,
        "-m",
        "mlx_redis_protocol.cli",
        "--log-level",
        "warning",
        "bench",
        "prefix",
        "--restored-from",
        cache_dir,
        *_workload_flags(args),
    ]
    result = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return [Timed(**t) for t in report["timed"]], report["facts"]


def _serve_restored(args: argparse.Namespace) -> int:
    """The child side of a restart: a new process, the saved cache, new questions."""
    model, tokenizer = load_model(args.model)
    workload = Workload.build(tokenizer, args, question_seed=200)
    timed, facts = serve(
        model, tokenizer, args, workload, cache=True, boundary=True, load_from=args.restored_from
    )
    print(json.dumps({"timed": [asdict(t) for t in timed], "facts": facts}))
    return 0


def _uncached_for(
    model: Any, tokenizer: Any, args: argparse.Namespace
) -> dict[tuple[int, int], list[int]]:
    """Uncached greedy outputs for the restarted process's questions (for the equality check)."""
    workload = Workload.build(tokenizer, args, question_seed=200)
    timed, _ = serve(model, tokenizer, args, workload, cache=False, boundary=False)
    return {(t.round, t.question): t.output_token_ids for t in timed}


def _same_outputs(timed: list[Timed], reference: dict[tuple[int, int], list[int]]) -> int:
    return sum(t.output_token_ids == reference[(t.round, t.question)] for t in timed)


def _p50(timed: list[Timed]) -> float:
    return statistics.median(t.ttft for t in timed)


def format_rows(rows: list[tuple[str, list[Timed]]], baseline: float) -> str:
    lines = [
        "| path | requests | cached tokens (avg) | TTFT p50 (ms) | TTFT min–max (ms) "
        "| speed-up vs no cache |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, timed in rows:
        ttfts = [t.ttft * 1e3 for t in timed]
        cached = statistics.fmean(t.cached_tokens for t in timed)
        lines.append(
            f"| {name} | {len(timed)} | {cached:.0f} | {_p50(timed) * 1e3:.0f} | "
            f"{min(ttfts):.0f}–{max(ttfts):.0f} | {baseline / _p50(timed):.1f}x |"
        )
    return "\n".join(lines)


def _workload_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        args.model,
        "--system-tokens",
        str(args.system_tokens),
        "--user-tokens",
        str(args.user_tokens),
        "--requests",
        str(args.requests),
        "--rounds",
        str(args.rounds),
        "--max-tokens",
        str(args.max_tokens),
    ]


def _describe(args: argparse.Namespace) -> str:
    import platform
    from importlib.metadata import version

    return (
        f"model {args.model}; system prompt {args.system_tokens} tokens + question "
        f"{args.user_tokens} tokens; {args.rounds} system prompts x {args.requests} questions, "
        f"one request at a time, {args.max_tokens} greedy tokens; device "
        f"{mx.default_device()}, {platform.machine()} {platform.system()}, "
        f"mlx {version('mlx')}, mlx-lm {version('mlx-lm')}"
    )
