"""``mlx-worker bench engine``: our engine against mlx-lm on the same load, in one run.

For each concurrency N, N requests arrive together (t0) and each path generates the same greedy
tokens: sequential ``mlx_lm.stream_generate`` (one request after another), raw mlx-lm
``BatchGenerator``, our ``generate_batch_sync``, and our async path (``add_request`` one after
another, then ``stream_outputs``). With ``--against vllm-mlx`` the same async load also runs
through vllm-mlx's ``EngineCore`` in a process of its own (the reference this engine replaces;
an optional install, e.g. ``pip install --no-deps vllm-mlx==0.6.0``: the bench says so when it
is missing). Reported:
generated tokens per second of wall time, and the average / p95 / p99 time to first token
measured from t0, and for our paths the engine's own host time per token (engine-thread step
time outside the generator: scheduling, detokenizing, outputs), the part of a step raw mlx-lm
does not pay. The prefix cache is off so no path reuses another's prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import multiprocessing
import multiprocessing.connection
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
        return _percentile(self.ttfts, 0.95)

    @property
    def ttft_p99(self) -> float:
        return _percentile(self.ttfts, 0.99)


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def make_prompts(tokenizer: Any, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Distinct prompts of ``length`` ordinary (non-special) tokens."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) | set(tokenizer.eos_token_ids)
    vocab = [t for t in range(min(len(tokenizer.get_vocab()), 30000)) if t not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(count)]


CHAT_TOPICS = (
    "dragons", "the ocean", "a lighthouse keeper", "bread", "the moon", "a lost key",
    "winter in a small town", "a robot learning to paint", "rivers", "an old library",
)  # fmt: skip


def make_chat_prompts(tokenizer: Any, count: int, seed: int = 0) -> list[list[int]]:
    """Distinct chat questions through the model's chat template: what a sampled request
    usually is (a trained model's next-token distribution after them is peaked, unlike after
    random tokens, which is what top-p's cost depends on)."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        topic = CHAT_TOPICS[(index + rng.randrange(len(CHAT_TOPICS))) % len(CHAT_TOPICS)]
        question = f"Tell me a story about {topic}, number {index}."
        messages = [{"role": "user", "content": question}]
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return prompts


def make_burst(
    tokenizer: Any, count: int, length: int, lengths: tuple[int, int] | None, seed: int
) -> list[list[int]]:
    """The burst's prompts: all of ``length`` tokens, or with ``lengths`` (MIN, MAX) each of a
    length drawn uniformly from that range by a generator seeded with ``seed``, so every path
    and every run gets the same mix (real bursts mix lengths: where shortest-first pays)."""
    if lengths is None:
        return make_prompts(tokenizer, count, length, seed=seed)
    rng = random.Random(seed)
    drawn = [rng.randint(*lengths) for _ in range(count)]
    longest = make_prompts(tokenizer, count, max(drawn), seed=seed)
    return [prompt[:size] for prompt, size in zip(longest, drawn, strict=True)]


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
    start = time.perf_counter()
    uids = generator.insert(prompts, [max_tokens] * len(prompts))
    tokens, ttfts = drain(generator, uids, start)
    seconds = time.perf_counter() - start
    generator.close()
    return PathResult("raw mlx-lm BatchGenerator", len(prompts), tokens, seconds, ttfts)


def drain(generator: Any, uids: list[int], start: float) -> tuple[int, list[float]]:
    """Step a batch generator (mlx-lm's, or mlx-vlm's of the same interface) until every
    sequence in ``uids`` finished: the tokens it generated (a stop token not counted) and each
    sequence's first-token time from ``start``."""
    first_token: dict[int, float] = {}
    tokens = 0
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
    return tokens, list(first_token.values())


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


async def stream_burst(engine: Any, prompts: list[list[int]], params: Any) -> PathResult:
    """Add every prompt one after another, then read every stream: tokens, each request's
    first-token time from t0, and the wall time (path and host time are filled by the caller).
    ``engine`` is ours or vllm-mlx's: both have ``add_request`` and ``stream_outputs``."""
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
    return PathResult("", len(prompts), tokens, time.perf_counter() - start, first_token)


@dataclass(frozen=True)
class Variant:
    """The streamed load again with other sampling parameters (``--logprobs``,
    ``--temperature``), timed against the same load without them."""

    name: str
    logprobs: int | None = None
    temperature: float = 0.0

    @property
    def path(self) -> str:
        return f"{VARIANT_PATH}{self.name} (same engine)"


def run_engine_async(
    engine: EngineCore, prompts: list[list[int]], max_tokens: int, variant: Variant | None = None
) -> PathResult:
    """The streamed path, greedy; with ``variant``, its sampling parameters."""

    sampling = variant or Variant("greedy")

    async def scenario() -> PathResult:
        before = engine.stats()
        params = SamplingParams(
            max_tokens=max_tokens, temperature=sampling.temperature, logprobs=sampling.logprobs
        )
        result = await stream_burst(engine, prompts, params)
        await engine.stop()
        result.path = ASYNC_PATH if variant is None else variant.path
        result.engine_host_us = engine_host_us(before, engine.stats())
        return result

    return asyncio.run(scenario())


ASYNC_PATH = "engine add_request + stream_outputs"
VARIANT_PATH = "engine streamed with "
VLLM_MLX_PATH = "vllm-mlx 0.6 EngineCore add_request + stream_outputs"


class VllmMlxProcess:
    """vllm-mlx's ``EngineCore`` (its defaults, prefix cache off as for ours) in a process of
    its own, which loads the same model and runs each burst it is sent.

    A process, not a thread beside ours: MLX streams belong to the thread that made them, and
    the two engines sharing one process ended in "There is no Stream(cpu, N) in current
    thread" at concurrency 32. The child waits on its pipe while the other paths run, so the
    rotation still times every path on the same machine state."""

    def __init__(self, model_name: str, max_tokens: int, max_num_seqs: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no MLX state shared
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_vllm_mlx_child,
            args=(child_conn, model_name, max_tokens, max_num_seqs),
            name="vllm-mlx-bench",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self.missing: str | None = self._receive()

    def __call__(self, prompts: list[list[int]]) -> PathResult:
        self._conn.send(prompts)
        result: PathResult = self._receive()
        return result

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()

    def _receive(self) -> Any:
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(
                f"the vllm-mlx bench process ended (exit code {self._process.exitcode})"
            ) from None
        if kind == "error":
            raise RuntimeError(f"vllm-mlx failed: {value}")
        return value


def _vllm_mlx_child(
    conn: multiprocessing.connection.Connection,
    model_name: str,
    max_tokens: int,
    max_num_seqs: int,
) -> None:
    """The child's loop: ("ready", None) or ("ready", why vllm-mlx is missing), then one
    ("result", PathResult) per list of prompts received, until None."""
    try:
        from vllm_mlx.engine_core import EngineConfig as VllmEngineConfig
        from vllm_mlx.engine_core import EngineCore as VllmEngineCore
        from vllm_mlx.request import SamplingParams as VllmSamplingParams
        from vllm_mlx.scheduler import SchedulerConfig as VllmSchedulerConfig
    except ImportError as exc:
        conn.send(("ready", str(exc)))
        return
    model, tokenizer = load_model(model_name)
    conn.send(("ready", None))

    async def scenario(prompts: list[list[int]]) -> PathResult:
        config = VllmSchedulerConfig(
            max_num_seqs=max_num_seqs,
            completion_batch_size=max_num_seqs,
            enable_prefix_cache=False,
        )
        engine = VllmEngineCore(model, tokenizer, VllmEngineConfig(scheduler_config=config))
        try:
            await engine.start()
            params = VllmSamplingParams(max_tokens=max_tokens, temperature=0.0)
            result = await stream_burst(engine, prompts, params)
            await engine.stop()
        finally:
            engine.close()
        result.path = VLLM_MLX_PATH
        return result

    while (prompts := conn.recv()) is not None:
        try:
            conn.send(("result", asyncio.run(scenario(prompts))))
        except Exception as exc:  # the parent reports it and stops the bench
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        mx.clear_cache()


def run_bench(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model)
    levels = [int(c) for c in str(args.concurrency).split(",")]
    config = SchedulerConfig(max_num_seqs=max(levels), enable_prefix_cache=False)
    if args.max_prefill_stall is not None:
        config.max_prefill_stall = args.max_prefill_stall
        config.__post_init__()  # checked as a built one is
    engine = EngineCore(
        model, tokenizer, EngineConfig(model_name=args.model, scheduler_config=config)
    )
    paths: list[tuple[str, Callable[[list[list[int]]], PathResult]]] = [
        ("sequential", lambda p: run_sequential(model, tokenizer, p, args.max_tokens)),
        ("batch", lambda p: run_batch_generator(model, tokenizer, p, args.max_tokens, config)),
        ("sync", lambda p: run_engine_sync(engine, p, args.max_tokens)),
        ("async", lambda p: run_engine_async(engine, p, args.max_tokens)),
    ]
    variants = []
    if args.logprobs is not None:
        variants.append(Variant(f"top logprobs {args.logprobs}", logprobs=args.logprobs))
    if args.temperature is not None:
        variants.append(Variant(f"temperature {args.temperature:g}", temperature=args.temperature))
    for variant in variants:
        paths.append(
            (
                variant.name,
                functools.partial(
                    run_engine_async, engine, max_tokens=args.max_tokens, variant=variant
                ),
            )
        )
    vllm: VllmMlxProcess | None = None
    if args.against == "vllm-mlx" and "vllm-mlx" not in (args.skip or "").split(","):
        vllm = VllmMlxProcess(args.model, args.max_tokens, max(levels))
        if vllm.missing is None:
            paths.append(("vllm-mlx", vllm))
        else:
            print(
                f"vllm-mlx is not installed ({vllm.missing}); `pip install --no-deps "
                "vllm-mlx==0.6.0` for --against vllm-mlx: that path is skipped"
            )
    skip = set(args.skip.split(",")) if args.skip else set()
    lengths: tuple[int, int] | None = args.prompt_lengths
    print(_describe(args, model))
    warmup = make_prompts(tokenizer, 2, args.prompt_tokens, seed=999)
    for name, run_path in paths:
        if name not in skip:
            run_path(warmup)
    runs: list[list[PathResult]] = []  # one list per (level, path), in rotation order
    try:
        for level in levels:
            if args.chat_prompts:
                prompts = make_chat_prompts(tokenizer, level, seed=level)
            else:
                prompts = make_burst(tokenizer, level, args.prompt_tokens, lengths, seed=level)
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
        if vllm is not None:
            vllm.close()
    print(format_table(runs))
    print(format_ratios(runs, levels))
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values)


def format_table(runs: list[list[PathResult]]) -> str:
    lines = [
        "| concurrency | path | tokens | tok/s (min–max) | decode tok/s | TTFT avg (ms) "
        "| TTFT p95 (ms) | TTFT p99 (ms) | engine own host µs/token |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
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
            f"{_median([r.ttft_p99 for r in repeats]) * 1e3:.0f} | "
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
    for level in levels:
        if (ours := find("engine add_request", level)) is None:
            continue
        for variant in (r for r in runs if r[0].concurrency == level):
            if variant[0].path.startswith(VARIANT_PATH):
                lines.append(
                    f"  concurrency {level}: {variant[0].path} / without tok/s = "
                    f"{ratio(variant, ours):.3f}"
                )
    for level in levels:
        ours, vllm = find("engine add_request", level), find("vllm-mlx", level)
        if ours and vllm:
            lines.append(
                f"  concurrency {level}: engine add_request / vllm-mlx EngineCore: "
                f"TTFT avg {_ratio_of(ours, vllm, lambda r: r.ttft_avg):.2f}x, "
                f"TTFT p99 {_ratio_of(ours, vllm, lambda r: r.ttft_p99):.2f}x, "
                f"tok/s {ratio(ours, vllm):.2f}x"
            )
    low, high = find("engine add_request", min(levels)), find("engine add_request", max(levels))
    if low and high and low is not high:
        lines.append(
            f"  async decode scaling: decode tok/s at {high[0].concurrency} / at "
            f"{low[0].concurrency} = {ratio(high, low, decode=True):.2f}x"
        )
    return "\n".join(lines)


def _ratio_of(
    a: list[PathResult], b: list[PathResult], measure: Callable[[PathResult], float]
) -> float:
    """Median over rotations of ``measure(a) / measure(b)`` within each rotation."""
    return _median([measure(x) / measure(y) for x, y in zip(a, b, strict=True)])


def _describe(args: argparse.Namespace, model: Any) -> str:
    import platform
    from importlib.metadata import version

    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    stall = "default" if args.max_prefill_stall is None else args.max_prefill_stall
    prompt = (
        "prompts of {}-{} tokens (uniform, seeded)".format(*args.prompt_lengths)
        if args.prompt_lengths
        else f"prompt {args.prompt_tokens} tokens"
    )
    return (
        f"{args.repeat} rotations; model {args.model} ({params / 1e6:.1f}M params), "
        f"device {mx.default_device()}, "
        f"{platform.machine()} {platform.system()}, {prompt}, "
        f"max_tokens {args.max_tokens}, max_prefill_stall {stall}, "
        f"mlx {version('mlx')}, mlx-lm {version('mlx-lm')}"
    )
