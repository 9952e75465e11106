"""``mlx-worker bench tools``: do the model's tool calls parse and validate, every time?

Each schema of the seeded suite (:mod:`mlx_redis_worker.bench.schema_suite`) becomes a
function; each function is offered alone in a chat that asks for it, rendered and constrained
exactly as the worker does a job (:func:`mlx_redis_worker.daemon.job_prompt.job_prompt`), its
output split by the same parser, sampled (0.7 by default). Two passes:

- ``required``: every answer must hold at least one call, and every call must parse and
  validate against its function's schema (jsonschema, draft 2020-12);
- ``auto``: how often the model chooses to call, and every call it makes must validate.

Each prompt asks for one call, so an answer holds one (``parallel_tool_calls`` false) unless
``--parallel`` lets it hold more: forced to call, a small model then tends to repeat its call
until ``--max-tokens``. An answer cut by ``--max-tokens`` is counted apart (a cut call is no
call). ``--slice`` runs part of the suite (each answer is seeded by its schema's index,
whatever the slice), so a long run can be split into parts that add up. The exit status is 1
when any call fails to validate or a ``required`` answer that ended holds no call.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mlx_redis_protocol.messages import ChatMessage, Job, Tool, ToolChoice
from mlx_redis_worker.bench.engine_runs import bench_engine, run_on_engine
from mlx_redis_worker.bench.schema_suite import (
    SuiteSchema,
    build_suite,
    llguidance_accepts,
    validation_error,
)
from mlx_redis_worker.daemon.job_prompt import JobPrompt, job_prompt
from mlx_redis_worker.engine import EngineCore, SamplingParams
from mlx_redis_worker.models import load_model

PASSES = ("required", "auto")


@dataclass(slots=True)
class PassResult:
    name: str
    answers: int = 0
    cut: int = 0  # ended by max_tokens
    with_calls: int = 0
    calls: int = 0
    invalid: list[str] = field(default_factory=list)  # "schema i: why"
    required_without_call: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def function_of(item: SuiteSchema) -> Tool:
    topic = item.description.split()[2]  # "Describe a TOPIC as ..."
    return Tool(
        name=f"record_{topic}_{item.index}", description=item.description, parameters=item.schema
    )


def job_of(item: SuiteSchema, mode: str, parallel: bool = False) -> Job:
    tool = function_of(item)
    ask = f"{item.description} Use the function {tool.name} to record it."
    return Job(
        request_id=f"{mode}-{item.index}",
        messages=(ChatMessage("user", ask),),
        tools=(tool,),
        tool_choice=ToolChoice("required") if mode == "required" else None,
        parallel_tool_calls=parallel,
    )


def suite_slice(items: list[SuiteSchema], spec: str | None) -> list[SuiteSchema]:
    """``START:STOP`` of the suite (``None``: all of it)."""
    if spec is None:
        return items
    start, _, stop = spec.partition(":")
    return items[int(start or 0) : int(stop) if stop else None]


def call_error(item: SuiteSchema, name: str, arguments: str) -> str:
    if name != function_of(item).name:
        return f"called {name!r}"
    error = validation_error(item.schema, arguments)
    return f"arguments {error}" if error else ""


async def run_pass(
    engine: EngineCore,
    tokenizer: Any,
    args: argparse.Namespace,
    items: list[SuiteSchema],
    mode: str,
) -> PassResult:
    result = PassResult(mode)
    slots = asyncio.Semaphore(args.batch)

    async def one(item: SuiteSchema) -> None:
        prompt: JobPrompt = job_prompt(job_of(item, mode, args.parallel), tokenizer)
        assert prompt.parser is not None
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=item.index,
            response_format=prompt.response_format,
        )
        async with slots:
            rid = await engine.add_request(prompt.prompt, params)
            final = None
            async for output in engine.stream_outputs(rid):
                prompt.parser.feed(output.new_text)
                final = output
        assert final is not None
        prompt.parser.finish()
        result.answers += 1
        result.tokens += final.completion_tokens
        if final.finish_reason == "length":
            result.cut += 1
        calls = prompt.parser.calls
        result.calls += len(calls)
        result.with_calls += bool(calls)
        for call in calls:
            error = call_error(item, call.name, call.arguments)
            if error:
                result.invalid.append(f"schema {item.index}: {error}")
        if mode == "required" and not calls and final.finish_reason != "length":
            result.required_without_call.append(item.index)

    started = time.perf_counter()
    await asyncio.gather(*(one(item) for item in items))
    result.seconds = time.perf_counter() - started
    return result


def run_tools_bench(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model)
    suite = build_suite(args.schemas, llguidance_accepts, seed=args.seed)
    items = suite_slice(suite.schemas, args.slice)
    passes = [name for name in args.passes.split(",") if name]
    unknown = set(passes) - set(PASSES)
    if unknown or not items:
        raise SystemExit(f"bench tools: unknown passes {sorted(unknown)} or an empty slice")
    engine = bench_engine(args.model, model, tokenizer, max_num_seqs=args.batch)
    print(
        f"model {args.model}, schemas {items[0].index}..{items[-1].index} of a suite of "
        f"{len(suite.schemas)} (seed {args.seed}), batch {args.batch}, max_tokens "
        f"{args.max_tokens}, temperature {args.temperature}, "
        f"{'parallel calls' if args.parallel else 'one call an answer'}",
        flush=True,
    )
    results: list[PassResult] = []

    async def scenario() -> None:
        for mode in passes:
            results.append(await run_pass(engine, tokenizer, args, items, mode))
            print(f"{mode} pass: {results[-1].seconds:.0f} s", flush=True)
            print(format_report(results[-1:])[0], flush=True)  # what a cut-short run has

    run_on_engine(engine, scenario)
    report, ok = format_report(results)
    print(report)
    return 0 if ok else 1


def format_report(results: list[PassResult]) -> tuple[str, bool]:
    lines = ["", "pass      answers  with calls  calls  valid calls  cut by max_tokens  tok"]
    ok = True
    for result in results:
        valid = result.calls - len(result.invalid)
        share = 100 * valid / result.calls if result.calls else 100.0
        rate = 100 * result.with_calls / result.answers if result.answers else 0.0
        lines.append(
            f"{result.name:<9} {result.answers:>7}  {result.with_calls:>4} ({rate:5.1f}%)"
            f"  {result.calls:>5}  {valid:>5} ({share:5.1f}%)  {result.cut:>17}  {result.tokens}"
        )
        ok = ok and not result.invalid and not result.required_without_call
    for result in results:
        for problem in result.invalid[:10]:
            lines.append(f"INVALID ({result.name}) {problem}")
        if result.required_without_call:
            lines.append(f"NO CALL (required): schemas {result.required_without_call[:20]}")
    lines.append("every call valid: " + ("yes" if ok else "NO"))
    return "\n".join(lines), ok
