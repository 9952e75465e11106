"""``mlx-worker bench structured``: JSON-schema constrained decoding, validity and cost.

On a seeded suite of varied schemas (``schema_suite``), with the model's chat template (system
"Reply with JSON only.", user: the schema's description and text):

- validity: every schema through the engine, ``--batch`` requests in flight at a time, at
  ``--temperature`` with fixed seeds. Every output that ended by ``stop`` must parse and
  validate with ``jsonschema``; outputs cut by ``max_tokens`` must say ``output_valid`` False.
- speed: ``--batch`` requests added together with the same prompts, constrained or not,
  alternating A B B A over ``--repeat`` rotations after a warm-up of each. Decode tok/s counts
  tokens 2..N of every request, N the shortest output of any run: the same decode steps at the
  same batch size and context lengths on both paths, whatever their output lengths. A probe
  around ``GrammarProcessor.__call__`` splits the grammar's host time (advance the matcher,
  compute the mask, build the MLX mask) from the wait for the previous step's token.
- compile: the first compile of each schema (p50/p99), then a second pass over the same
  schemas through the compiler's cache, all of which must be hits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_redis_worker.bench.engine_runs import bench_engine, run_on_engine
from mlx_redis_worker.bench.schema_suite import (
    Suite,
    SuiteSchema,
    build_suite,
    llguidance_accepts,
    validation_error,
)
from mlx_redis_worker.engine import (
    EngineCore,
    ResponseFormat,
    SamplingParams,
)
from mlx_redis_worker.engine.grammar_rows import GrammarProcessor
from mlx_redis_worker.models import load_model

SYSTEM = "Reply with JSON only."
CONSTRAINED, UNCONSTRAINED = "constrained", "unconstrained"


@dataclass(slots=True)
class Final:
    """One validity request's end."""

    item: SuiteSchema
    finish_reason: str | None
    output_valid: bool | None
    text: str
    completion_tokens: int
    error: str = ""  # why jsonschema (or json) rejects the text; "" when it validates


@dataclass(slots=True)
class SpeedRun:
    """Requests added together: the arrival time of each one's every token, in order."""

    path: str
    arrivals: list[list[float]]

    @property
    def steps(self) -> int:
        """Tokens of the shortest request: all of them were generating up to that one."""
        return min(len(times) for times in self.arrivals)

    @property
    def completion_tokens(self) -> int:
        return sum(len(times) for times in self.arrivals)

    def decode_tokens_per_second(self, steps: int) -> float:
        """Tokens 2..``steps`` of every request over the time they took: the same decode steps
        at the same batch size (and context lengths) whichever path, whatever its lengths."""
        if steps < 2:
            return 0.0
        start = max(times[0] for times in self.arrivals)
        end = max(times[steps - 1] for times in self.arrivals)
        return (steps - 1) * len(self.arrivals) / (end - start) if end > start else 0.0


@dataclass(slots=True)
class GrammarProbe:
    """Time inside ``GrammarProcessor.__call__``, installed around the constrained speed runs."""

    calls: int = 0
    wait_seconds: float = 0.0  # for the previous step's token (the matcher must consume it)
    host_seconds: float = 0.0  # the rest: consume, mask, MLX mask ops (built, not evaluated)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        original = GrammarProcessor.__call__

        def timed(processor: GrammarProcessor, tokens: Any, logits: Any) -> Any:
            started = time.perf_counter()
            mx.eval(tokens)
            ready = time.perf_counter()
            masked = original(processor, tokens, logits)
            self.wait_seconds += ready - started
            self.host_seconds += time.perf_counter() - ready
            self.calls += 1
            return masked

        setattr(GrammarProcessor, "__call__", timed)  # noqa: B010 (a method: mypy refuses `=`)
        try:
            yield
        finally:
            setattr(GrammarProcessor, "__call__", original)  # noqa: B010


@dataclass(slots=True)
class Results:
    suite: Suite
    finals: list[Final] = field(default_factory=list)
    engine_refused: list[int] = field(default_factory=list)
    validity_seconds: float = 0.0
    runs: dict[str, list[SpeedRun]] = field(default_factory=dict)
    probe: GrammarProbe = field(default_factory=GrammarProbe)
    compile_seconds: list[float] = field(default_factory=list)
    second_pass_hits: int = 0
    second_pass_compiled: int = 0


def chat_prompt(tokenizer: Any, item: SuiteSchema) -> str:
    user = f"{item.description}\nSchema: {json.dumps(item.schema, separators=(',', ':'))}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def params(args: argparse.Namespace, item: SuiteSchema, constrained: bool) -> SamplingParams:
    fmt = ResponseFormat("json_schema", schema=item.schema) if constrained else None
    limits = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return SamplingParams(**limits, seed=item.index, response_format=fmt)


async def run_validity(
    engine: EngineCore, args: argparse.Namespace, prompts: list[str], results: Results
) -> None:
    slots = asyncio.Semaphore(args.batch)

    async def one(item: SuiteSchema) -> None:
        async with slots:
            try:
                rid = await engine.add_request(prompts[item.index], params(args, item, True))
            except ValueError:
                results.engine_refused.append(item.index)
                return
            final = None
            async for output in engine.stream_outputs(rid):
                final = output
        assert final is not None
        reason, text = final.finish_reason, final.output_text
        error = validation_error(item.schema, text) if reason == "stop" else ""
        tokens = final.completion_tokens
        results.finals.append(Final(item, reason, final.output_valid, text, tokens, error))

    started = time.perf_counter()
    await asyncio.gather(*(one(item) for item in results.suite.schemas))
    results.validity_seconds = time.perf_counter() - started
    results.finals.sort(key=lambda f: f.item.index)


async def speed_run(
    engine: EngineCore,
    args: argparse.Namespace,
    prompts: list[str],
    items: list[SuiteSchema],
    path: str,
) -> SpeedRun:
    """``items`` added together, each token's arrival time recorded."""
    arrivals: list[list[float]] = []

    async def consume(rid: str) -> None:
        times: list[float] = []
        arrivals.append(times)
        async for output in engine.stream_outputs(rid):
            times.extend([time.perf_counter()] * len(output.new_token_ids))

    ids = [
        await engine.add_request(prompts[item.index], params(args, item, path == CONSTRAINED))
        for item in items
    ]
    await asyncio.gather(*(consume(rid) for rid in ids))
    return SpeedRun(path, arrivals)


async def run_speed(
    engine: EngineCore, args: argparse.Namespace, prompts: list[str], results: Results
) -> None:
    """The ``--batch`` schemas with the longest constrained outputs: the longest windows."""
    by_length = sorted(results.finals, key=lambda f: (-f.completion_tokens, f.item.index))
    items = [f.item for f in by_length[: args.batch]]
    for path in (CONSTRAINED, UNCONSTRAINED):  # warm-up, not counted
        await speed_run(engine, args, prompts, items, path)
    results.runs = {CONSTRAINED: [], UNCONSTRAINED: []}
    for rotation in range(args.repeat):  # A B B A ...: drift hits both paths alike
        order = (CONSTRAINED, UNCONSTRAINED) if rotation % 2 == 0 else (UNCONSTRAINED, CONSTRAINED)
        for path in order:
            mx.clear_cache()
            probe = results.probe.installed() if path == CONSTRAINED else contextlib.nullcontext()
            with probe:
                results.runs[path].append(await speed_run(engine, args, prompts, items, path))


def second_pass(engine: EngineCore, results: Results) -> None:
    """Every schema again through the compiler (what ``add_request`` does): all cache hits."""
    stats = engine.scheduler.grammars.stats
    results.compile_seconds = list(stats.compile_seconds)
    hits, compiled = stats.cache_hits, stats.compiled
    for item in results.suite.schemas:
        if item.index not in results.engine_refused:
            engine.scheduler.grammars.compile(ResponseFormat("json_schema", schema=item.schema))
    results.second_pass_hits = stats.cache_hits - hits
    results.second_pass_compiled = stats.compiled - compiled


def run_structured_bench(args: argparse.Namespace) -> int:
    if args.hostile:
        from mlx_redis_worker.bench.hostile_bench import run_hostile_bench

        return run_hostile_bench(args)
    model, tokenizer = load_model(args.model)
    suite = build_suite(args.schemas, llguidance_accepts, seed=args.seed)
    prompts = [chat_prompt(tokenizer, item) for item in suite.schemas]
    engine = bench_engine(args.model, model, tokenizer, max_num_seqs=args.batch)
    results = Results(suite)
    print(
        f"model {args.model}, {len(suite.schemas)} schemas (seed {args.seed}), batch "
        f"{args.batch}, max_tokens {args.max_tokens}, temperature {args.temperature}, "
        f"{args.repeat} rotations, device {mx.default_device()}",
        flush=True,
    )

    async def scenario() -> None:
        await run_validity(engine, args, prompts, results)
        print(f"validity pass: {results.validity_seconds:.0f} s", flush=True)
        second_pass(engine, results)
        started = time.perf_counter()
        await run_speed(engine, args, prompts, results)
        print(f"speed runs: {time.perf_counter() - started:.0f} s", flush=True)

    run_on_engine(engine, scenario)
    report, ok = format_report(results, args)
    print(report)
    return 0 if ok else 1


def percentile(values: list[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def format_report(results: Results, args: argparse.Namespace) -> tuple[str, bool]:
    """The tables, and whether every correctness check held (the speed goal is reported)."""
    finals = results.finals
    stopped = [f for f in finals if f.finish_reason == "stop"]
    invalid = [f for f in stopped if f.error]
    cut = [f for f in finals if f.finish_reason == "length"]
    other = [f for f in finals if f.finish_reason not in ("stop", "length")]
    agree = sum(f.output_valid is (f.finish_reason == "stop" and not f.error) for f in finals)
    tokens = sum(f.completion_tokens for f in finals)
    suite = results.suite
    lines = [
        "",
        f"Validity ({len(suite.schemas)} schemas; suite dropped {suite.refused} refused by "
        f"llguidance, regenerated {suite.oversized} oversized; engine refused "
        f"{len(results.engine_refused)}):",
        "| finished | stop | valid (jsonschema) | invalid | cut by max_tokens | cut with "
        "output_valid False | other | output_valid agrees | tokens | tok/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(finals)} | {len(stopped)} | {len(stopped) - len(invalid)} | {len(invalid)} "
        f"| {len(cut)} | {sum(f.output_valid is False for f in cut)} | {len(other)} "
        f"| {agree}/{len(finals)} | {tokens} | {tokens / results.validity_seconds:.1f} |",
    ]
    for f in invalid + other:
        lines.append(
            f"  OFFENDER #{f.item.index} ({f.finish_reason}): {f.error}\n"
            f"    schema: {json.dumps(f.item.schema)}\n    output: {f.text!r}"
        )
    compile_ms = [s * 1e3 for s in results.compile_seconds]
    n_checked = len(suite.schemas) - len(results.engine_refused)
    lines += [
        "",
        "Compile (first compile of each schema; second pass through the cache):",
        "| compiled | p50 ms | p99 ms | max ms | second pass hits | second pass compiles |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {len(compile_ms)} | {percentile(compile_ms, 0.5):.2f} | "
        f"{percentile(compile_ms, 0.99):.2f} | {max(compile_ms):.2f} | "
        f"{results.second_pass_hits}/{n_checked} | {results.second_pass_compiled} |",
    ]
    lines += format_speed(results, args)
    ok = (
        not invalid
        and not other
        and not results.engine_refused
        and agree == len(finals)
        and results.second_pass_hits == n_checked
        and results.second_pass_compiled == 0
    )
    lines.append(f"\ncorrectness checks: {'all held' if ok else 'FAILED'}")
    return "\n".join(lines), ok


def format_speed(results: Results, args: argparse.Namespace) -> list[str]:
    runs = results.runs
    steps = min(run.steps for path_runs in runs.values() for run in path_runs)
    lines = [
        "",
        f"Decode speed at batch {args.batch} (the same {args.batch} prompts added together; "
        f"tokens 2..{steps} of each, the steps where all {args.batch} run on both paths; "
        f"A B B A over {args.repeat} rotations):",
        "| path | runs | shortest output (tokens) | completion tokens "
        "| decode tok/s median (min–max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for path in (UNCONSTRAINED, CONSTRAINED):
        speeds = [r.decode_tokens_per_second(steps) for r in runs[path]]
        lines.append(
            f"| {path} | {len(speeds)} | {min(r.steps for r in runs[path])} "
            f"| {runs[path][0].completion_tokens} "
            f"| {statistics.median(speeds):.1f} ({min(speeds):.1f}–{max(speeds):.1f}) |"
        )
    ratios = [
        c.decode_tokens_per_second(steps) / u.decode_tokens_per_second(steps)
        for c, u in zip(runs[CONSTRAINED], runs[UNCONSTRAINED], strict=True)
        if u.decode_tokens_per_second(steps) > 0
    ]
    if ratios:
        ratio = statistics.median(ratios)
        lines.append(
            f"\nconstrained / unconstrained decode tok/s = {ratio:.3f} (per-rotation "
            f"{', '.join(f'{r:.3f}' for r in ratios)}); goal >= 0.9: "
            f"{'met' if ratio >= 0.9 else 'NOT met'}"
        )
    else:
        lines.append("\nconstrained / unconstrained decode tok/s: - (outputs too short)")
    probe = results.probe
    speed = statistics.median(r.decode_tokens_per_second(steps) for r in runs[CONSTRAINED])
    if probe.calls and speed > 0:
        host_ms = probe.host_seconds / probe.calls * args.batch * 1e3
        step_ms = args.batch / speed * 1e3
        lines.append(
            f"grammar host time per sequence-step (consume + mask + MLX mask ops, "
            f"{probe.calls} calls): {host_ms / args.batch * 1e3:.0f} µs; x{args.batch} = "
            f"{host_ms:.2f} ms per decode step of {step_ms:.1f} ms ({host_ms / step_ms:.1%}); "
            f"wait for the previous step's token: {probe.wait_seconds / probe.calls * 1e6:.0f} "
            "µs per call"
        )
    return lines
