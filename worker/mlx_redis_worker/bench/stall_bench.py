"""``mlx-worker bench stall``: what one long prompt costs the streams already running.

For each long-prompt length and each ``max_prefill_stall`` (in rotation, on one loaded model):
an engine with ``--streams`` greedy streams decoding (their EOS masked: they run until the
bench ends them) measures their steady inter-token gap, then the long prompt arrives. Until
its first token, every gap of every stream is recorded (engine steps timed on the event loop
by the engine's step listener). Reported: the gaps' p50 / p99 / max as multiples of the
steady gap measured in the same engine just before, the long prompt's time to first token, and
the streams' tokens per engine step meanwhile (1.0: no step skipped a stream). ``inf`` is the
whole-chunk bound (a full ``prefill_step_size`` chunk beside each decode step); the engine
before stall-free scheduling skipped up to 8 decode steps in a row on top of that.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.engine import EngineConfig, EngineCore, SamplingParams, SchedulerConfig
from mlx_redis_worker.engine.request import RequestOutput
from mlx_redis_worker.models import load_model

STEADY_STEPS = 40  # steps of the streams alone, after a warm-up of as many


@dataclass(slots=True)
class StallResult:
    long_tokens: int
    stall: float
    steady_gap: float  # seconds: median gap of the streams alone
    gaps: list[float]  # seconds: every stream's gaps while the long prompt prefilled
    ttft: float  # seconds: the long prompt's first token from its arrival
    stream_tokens: int
    steps: int
    streams: int

    def ratio(self, share: float) -> float:
        return _percentile(self.gaps, share) / self.steady_gap


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def endless(tokenizer: Any) -> SamplingParams:
    """Greedy, the model's EOS masked out: a stream runs until it is aborted."""
    eos = mx.array(sorted(tokenizer.eos_token_ids))

    def no_eos(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, eos].add(-mx.inf)

    return SamplingParams(max_tokens=1 << 30, temperature=0.0, logits_processors=[no_eos])


class StepClock:
    """The engine's step listener: the event-loop time of each step that streamed a token to
    one of the streams, and those tokens."""

    def __init__(self, stream_ids: set[str]) -> None:
        self.stream_ids = stream_ids
        self.last: dict[str, float] = {}
        self.gaps: list[float] = []
        self.tokens = 0
        self.steps = 0
        self.recording = False
        self.step_event = asyncio.Event()

    def __call__(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        self.steps += 1
        for output in outputs:
            count = len(output.new_token_ids)
            if output.request_id not in self.stream_ids or not count:
                continue
            previous = self.last.get(output.request_id)
            self.last[output.request_id] = now
            self.tokens += count
            if previous is not None and self.recording:
                # Merged deltas (a late reader) spread their gap over their tokens.
                self.gaps.extend([(now - previous) / count] * count)
        self.step_event.set()

    def start(self) -> None:
        self.gaps, self.tokens, self.steps, self.recording = [], 0, 0, True

    async def wait_steps(self, steps: int) -> None:
        target = self.steps + steps
        while self.steps < target:
            self.step_event.clear()
            await self.step_event.wait()


def measure(
    model: Any, tokenizer: Any, streams: int, long_tokens: int, stall: float, seed: int
) -> StallResult:
    config = SchedulerConfig(
        max_num_seqs=streams + 1,
        enable_prefix_cache=False,
        max_prefill_stall=stall,
        max_prompt_tokens=max(long_tokens, SchedulerConfig().max_prompt_tokens),
    )
    engine = EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))
    prompts = make_prompts(tokenizer, streams, 24, seed=seed)
    (long_prompt,) = make_prompts(tokenizer, 1, long_tokens, seed=seed + 1)

    async def scenario() -> StallResult:
        await engine.start()
        ids = [await engine.add_request(p, endless(tokenizer), collect=False) for p in prompts]
        clock = StepClock(set(ids))
        engine.set_step_listener(clock)
        try:
            await clock.wait_steps(STEADY_STEPS)  # past every stream's first tokens
            clock.start()
            await clock.wait_steps(STEADY_STEPS)
            steady = statistics.median(clock.gaps)
            clock.start()
            arrived = time.perf_counter()
            long_id = await engine.add_request(long_prompt, SamplingParams(max_tokens=1))
            async for _ in engine.stream_outputs(long_id):
                pass
            ttft = time.perf_counter() - arrived
            result = StallResult(
                long_tokens, stall, steady, clock.gaps, ttft, clock.tokens, clock.steps, streams
            )
        finally:
            engine.set_step_listener(None)
            for request_id in ids:
                await engine.abort_request(request_id)
            await engine.stop()
        return result

    try:
        return asyncio.run(scenario())
    finally:
        engine.close()


def run_stall_bench(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model)
    lengths = [int(n) for n in str(args.long).split(",")]
    stalls = [float(s) for s in str(args.stalls).split(",")]
    print(
        f"model {args.model}, {args.streams} streams, long prompts {lengths}, "
        f"max_prefill_stall {stalls}, {args.repeat} rotation(s), device {mx.default_device()}, "
        f"loadavg {_loadavg()}"
    )
    measure(model, tokenizer, args.streams, 64, stalls[0], seed=99)  # warm-up
    results: list[StallResult] = []
    for length in lengths:
        for rotation in range(args.repeat):  # A B A B: drift hits every policy alike
            for stall in stalls:
                results.append(
                    measure(model, tokenizer, args.streams, length, stall, seed=rotation)
                )
                mx.clear_cache()
    print(format_table(results))
    print(f"loadavg at the end {_loadavg()}")
    return 0


def format_table(results: list[StallResult]) -> str:
    lines = [
        "| long prompt | max_prefill_stall | steady gap ms | gap p50 × | gap p99 × | gap max × "
        "| long TTFT s | tokens / stream / step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r.long_tokens, r.stall) for r in results}, key=lambda k: (k[0], -k[1]))
    for length, stall in keys:
        runs = [r for r in results if (r.long_tokens, r.stall) == (length, stall)]
        lines.append(
            f"| {length:,} | {'inf (whole chunks)' if math.isinf(stall) else stall} "
            f"| {_median([r.steady_gap * 1e3 for r in runs]):.1f} "
            f"| {_median([r.ratio(0.5) for r in runs]):.1f} "
            f"| {_median([r.ratio(0.99) for r in runs]):.1f} "
            f"| {_median([max(r.gaps) / r.steady_gap for r in runs]):.1f} "
            f"| {_median([r.ttft for r in runs]):.2f} "
            f"| {_median([r.stream_tokens / max(r.steps * r.streams, 1) for r in runs]):.2f} |"
        )
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
