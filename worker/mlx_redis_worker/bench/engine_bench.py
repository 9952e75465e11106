"""``mlx-worker bench engine``: our engine against mlx-lm on the same load, in one run.

For each concurrency N, N requests arrive together (t0) and each path generates the same greedy
tokens: sequential ``mlx_lm.stream_generate`` (one request after another), raw mlx-lm
``BatchGenerator``, our ``generate_batch_sync``, and our async path (``add_request`` one after
another, then ``stream_outputs``). Reported: generated tokens per second of wall time, and the
average / p95 time to first token measured from t0, and for our paths the engine's own host
time per token (engine-thread step time outside ``BatchGenerator.next``: scheduling,
detokenizing, outputs), the part of a step raw mlx-lm does not pay. The prefix cache is off so no
path reuses another's prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator

from mlx_redis_worker.engine import (
    EngineConfig,
    EngineCore,
    EngineStats,
    SamplingParams,
    SchedulerConfig,
)
from mlx_redis_worker.models import load_model


@dataclass(slots=True)
class PathResult:
    path: str
    concurrency: int
    tokens: int
    seconds: float
    ttfts: list[float]
    engine_host_us: float | None = None  # engine's own host µs per token (our paths only)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after each request's first, over the time from the first token to the end."""
        return (self.tokens - len(self.ttfts)) / (self.seconds - min(self.ttfts))

    @property
    def ttft_avg(self) -> float:
        return statistics.fmean(self.ttfts)

    @property
    def ttft_p95(self) -> float:
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def make_prompts(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of ``length`` ordinary (non-special) tokens."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) | set(tokenizer.eos_token_ids)
    vocab = [t for t in range(min(len(tokenizer.get_vocab()), 30000)) if t not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(count)]


def run_sequential(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int
) -> PathResult:
    ttfts, tokens = [], 0
    start = time.perf_counter()
    for prompt in prompts:
        first = True
        for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
            if first:
                ttfts.append(time.perf_counter() - start)
                first = False
            tokens += 1
    return PathResult(
        "mlx_lm.stream_generate (sequential)",
        len(prompts),
        tokens,
        time.perf_counter() - start,
        ttfts,
    )


def run_batch_generator(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, config: SchedulerConfig
) -> PathResult:
    generator = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=config.max_num_seqs,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
    )
    first_token: dict[int, float] = {}
    tokens = 0
    start = time.perf_counter()
    uids = generator.insert(prompts, [max_tokens] * len(prompts))
    remaining = set(uids)
    while remaining:
        _, responses = generator.next()
        now = time.perf_counter()
        for response in responses:
            first_token.setdefault(response.uid, now - start)
            if response.finish_reason != "stop":
                tokens += 1
            if response.finish_reason is not None:
                remaining.discard(response.uid)
    seconds = time.perf_counter() - start
    generator.close()
    return PathResult(
        "raw mlx-lm BatchGenerator", len(prompts), tokens, seconds, list(first_token.values())
    )


def engine_host_us(before: EngineStats, after: EngineStats) -> float:
    """The engine's own host µs per generated token between two ``stats()`` snapshots."""
    tokens = after.scheduler.total_completion_tokens - before.scheduler.total_completion_tokens
    model = after.scheduler.model_seconds - before.scheduler.model_seconds
    steps = after.step_seconds - before.step_seconds
    return (steps - model) / max(tokens, 1) * 1e6


def run_engine_sync(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> PathResult:
    before = engine.stats()
    start = time.perf_counter()
    outputs = engine.generate_batch_sync(
        list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )
    seconds = time.perf_counter() - start
    tokens = sum(o.completion_tokens for o in outputs)
    ttfts = [o.ttft for o in outputs if o.ttft is not None]
    return PathResult(
        "engine generate_batch_sync",
        len(prompts),
        tokens,
        seconds,
        ttfts,
        engine_host_us(before, engine.stats()),
    )


def run_engine_async(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> PathResult:
    async def scenario() -> PathResult:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        before = engine.stats()
        start = time.perf_counter()
        first_token: list[float] = []
        tokens = 0

        async def consume(request_id: str) -> None:
            nonlocal tokens
            first = True
            async for output in engine.stream_outputs(request_id):
                if first and output.new_token_ids:
                    first_token.append(time.perf_counter() - start)
                    first = False
                tokens += len(output.new_token_ids)

        ids = [await engine.add_request(list(p), params) for p in prompts]
        await asyncio.gather(*(consume(rid) for rid in ids))
        seconds = time.perf_counter() - start
        await engine.stop()
        return PathResult(
            "engine add_request + stream_outputs",
            len(prompts),
            tokens,
            seconds,
            first_token,
            engine_host_us(before, engine.stats()),
        )

    return asyncio.run(scenario())


def run_bench(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model)
    levels = [int(c) for c in str(args.concurrency).split(",")]
    config = SchedulerConfig(max_num_seqs=max(levels), enable_prefix_cache=False)
    engine = EngineCore(
        model, tokenizer, EngineConfig(model_name=args.model, scheduler_config=config)
    )
    paths: list[tuple[str, Callable[[list[list[int]]], PathResult]]] = [
        ("sequential", lambda p: run_sequential(model, tokenizer, p, args.max_tokens)),
        ("batch", lambda p: run_batch_generator(model, tokenizer, p, args.max_tokens, config)),
        ("sync", lambda p: run_engine_sync(engine, p, args.max_tokens)),
        ("async", lambda p: run_engine_async(engine, p, args.max_tokens)),
    ]
    skip = set(args.skip.split(",")) if args.skip else set()
    print(_describe(args, model))
    warmup = make_prompts(tokenizer, 2, args.prompt_tokens, seed=999)
    for name, run_path in paths:
        if name not in skip:
            run_path(warmup)
    runs: list[list[PathResult]] = []  # one list per (level, path), in rotation order
    try:
        for level in levels:
            prompts = make_prompts(tokenizer, level, args.prompt_tokens, seed=level)
            chosen = [
                run_path
                for name, run_path in paths
                if name not in skip and not (name == "sequential" and level > args.sequential_max)
            ]
            level_runs: list[list[PathResult]] = [[] for _ in chosen]
            for _ in range(args.repeat):  # A B C A B C ...: drift hits every path alike
                for index, run_path in enumerate(chosen):
                    level_runs[index].append(run_path(prompts))
                    mx.clear_cache()
            runs.extend(level_runs)
    finally:
        engine.close()
    print(format_table(runs))
    print(format_ratios(runs, levels))
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values)


def format_table(runs: list[list[PathResult]]) -> str:
    lines = [
        "| concurrency | path | tokens | tok/s (min–max) | decode tok/s | TTFT avg (ms) "
        "| TTFT p95 (ms) | engine own host µs/token |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for repeats in runs:
        first = repeats[0]
        speeds = [r.tokens_per_second for r in repeats]
        host = [r.engine_host_us for r in repeats if r.engine_host_us is not None]
        spread = f" ({min(speeds):.0f}–{max(speeds):.0f})" if len(repeats) > 1 else ""
        lines.append(
            f"| {first.concurrency} | {first.path} | {first.tokens} | "
            f"{_median(speeds):.1f}{spread} | "
            f"{_median([r.decode_tokens_per_second for r in repeats]):.1f} | "
            f"{_median([r.ttft_avg for r in repeats]) * 1e3:.0f} | "
            f"{_median([r.ttft_p95 for r in repeats]) * 1e3:.0f} | "
            f"{f'{_median(host):.1f}' if host else '-'} |"
        )
    return "\n".join(lines)


def format_ratios(runs: list[list[PathResult]], levels: list[int]) -> str:
    """Median over repeats of the ratio within each rotation (robust to a drifting machine)."""

    def find(path_prefix: str, level: int) -> list[PathResult] | None:
        return next(
            (r for r in runs if r[0].concurrency == level and r[0].path.startswith(path_prefix)),
            None,
        )

    def ratio(a: list[PathResult], b: list[PathResult], decode: bool = False) -> float:
        def speed(r: PathResult) -> float:
            return r.decode_tokens_per_second if decode else r.tokens_per_second

        return _median([speed(x) / speed(y) for x, y in zip(a, b, strict=True)])

    lines = ["", "Ratios of tok/s (median of per-rotation ratios, same run):"]
    for level in levels:
        raw = find("raw", level)
        for prefix in ("engine add_request", "engine generate_batch_sync"):
            ours = find(prefix, level)
            if raw and ours:
                lines.append(
                    f"  concurrency {level}: {ours[0].path} / raw BatchGenerator tok/s = "
                    f"{ratio(ours, raw):.3f}"
                )
    low, high = find("engine add_request", min(levels)), find("engine add_request", max(levels))
    if low and high and low is not high:
        lines.append(
            f"  async decode scaling: decode tok/s at {high[0].concurrency} / at "
            f"{low[0].concurrency} = {ratio(high, low, decode=True):.2f}x"
        )
    return "\n".join(lines)


def _describe(args: argparse.Namespace, model: Any) -> str:
    import platform
    from importlib.metadata import version

    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return (
        f"{args.repeat} rotations; model {args.model} ({params / 1e6:.1f}M params), "
        f"device {mx.default_device()}, "
        f"{platform.machine()} {platform.system()}, prompt {args.prompt_tokens} tokens, "
        f"max_tokens {args.max_tokens}, mlx {version('mlx')}, mlx-lm {version('mlx-lm')}"
    )
