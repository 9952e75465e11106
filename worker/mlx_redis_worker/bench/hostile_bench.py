"""``mlx-worker bench structured --hostile``: what a hostile-schema tenant costs everyone else.

A victim request (unconstrained, greedy) decodes while an attacker keeps ``--attackers``
requests in flight, in one engine, one model. Its decode tok/s (tokens 2..N over their time)
in each mode, over its tok/s alone in the same rotation:

- ``alone``: the victim by itself (the baseline of every ratio).
- ``plain``: the attacker's requests carry no format: a plain second tenant, the yardstick of
  what sharing the machine costs at all (on a 2-core CPU it is far from free).
- ``fresh``: each attacker request a new hostile schema (a new cache key: a compile each).
- ``cached``: one hostile schema for every attacker request (compiled once, then cache hits).

Modes rotate in a different order each rotation (A B C D, D C B A, ...), so drift hits all
alike; the ratio is the median over rotations. Attacker schemas are built before any run, so
making them costs the victim nothing. The engine runs with the worker's grammar limits
(``--max-schema-bytes`` and the others; their defaults are the worker's): by default the large
kinds are refused by size, and raising the limit shows what the costs themselves do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_redis_worker.bench.engine_runs import bench_engine, run_on_engine
from mlx_redis_worker.bench.hostile_schemas import KINDS, hostile_schema, schema_bytes
from mlx_redis_worker.engine import (
    EngineCore,
    ResponseFormat,
    SamplingParams,
)
from mlx_redis_worker.engine.config import GRAMMAR_LIMITS, GrammarLimits
from mlx_redis_worker.models import load_model

MODES = ("alone", "plain", "fresh", "cached")
VICTIM_PROMPT = "Write a long story about a lighthouse keeper and the sea, in many chapters."
ATTACKER_PROMPT = "Reply with JSON."


@dataclass(slots=True)
class Attack:
    """What the attacker's requests met in one run."""

    started: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    finished: int = 0

    def refuse(self, message: str) -> None:
        limit = next((name for name in GRAMMAR_LIMITS if name in message), "other")
        self.refused[limit] = self.refused.get(limit, 0) + 1


@dataclass(slots=True)
class Results:
    tokens_per_second: dict[str, list[float]] = field(
        default_factory=lambda: {mode: [] for mode in MODES}
    )
    attacks: dict[str, list[Attack]] = field(default_factory=lambda: {m: [] for m in MODES})

    def alone(self) -> list[float]:
        return self.tokens_per_second["alone"]

    def ratios(self, mode: str) -> list[float]:
        return [
            with_attack / alone
            for with_attack, alone in zip(
                self.tokens_per_second[mode], self.tokens_per_second["alone"], strict=True
            )
        ]


def victim_prompt(tokenizer: Any) -> str:
    """The story request in the model's chat template, where it has one (an instruct model
    given raw text may end at once)."""
    if not getattr(tokenizer, "chat_template", None):
        return VICTIM_PROMPT
    messages = [{"role": "user", "content": VICTIM_PROMPT}]
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


async def victim_tokens_per_second(engine: EngineCore, prompt: str, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rid = await engine.add_request(prompt, params)
    arrivals: list[float] = []
    async for output in engine.stream_outputs(rid):
        arrivals.extend([time.perf_counter()] * len(output.new_token_ids))
    if len(arrivals) < 3:
        raise RuntimeError(f"the victim produced {len(arrivals)} tokens: too few to time")
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


async def attacker(
    engine: EngineCore, params: list[SamplingParams], attack: Attack, stop: asyncio.Event
) -> None:
    """One attacker slot: a request after another until ``stop``; each refused one counted."""
    index = 0
    while not stop.is_set():
        attack.started += 1
        try:
            rid = await engine.add_request(ATTACKER_PROMPT, params[index % len(params)])
        except ValueError as exc:
            attack.refuse(str(exc))
        else:
            try:
                async for _ in engine.stream_outputs(rid):
                    if stop.is_set():
                        await engine.abort_request(rid)
                        break
                attack.finished += 1
            except asyncio.CancelledError:
                await engine.abort_request(rid)
                raise
        index += 1
        await asyncio.sleep(0)


def attacker_params(args: argparse.Namespace, mode: str, rotation: int) -> list[SamplingParams]:
    common: dict[str, Any] = {"max_tokens": args.attacker_tokens, "temperature": 0.0}
    if mode == "plain":
        return [SamplingParams(**common)]
    if mode == "cached":
        schemas = [hostile_schema(args.kind, "cached")]
    else:  # fresh: a salt never used before in this run
        schemas = [hostile_schema(args.kind, f"r{rotation}n{i}") for i in range(args.fresh)]
    return [
        SamplingParams(**common, response_format=ResponseFormat("json_schema", schema=schema))
        for schema in schemas
    ]


async def one_run(
    engine: EngineCore, args: argparse.Namespace, mode: str, params: list[SamplingParams]
) -> tuple[float, Attack]:
    attack = Attack()
    stop = asyncio.Event()
    tasks = []
    if mode != "alone":
        tasks = [
            asyncio.create_task(attacker(engine, params, attack, stop))
            for _ in range(args.attackers)
        ]
        await asyncio.sleep(args.head_start)  # the attack is under way before the victim
    try:
        tokens_per_second = await victim_tokens_per_second(
            engine, args.victim_prompt, args.max_tokens
        )
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return tokens_per_second, attack


async def run_modes(engine: EngineCore, args: argparse.Namespace, results: Results) -> None:
    await one_run(engine, args, "alone", [])  # warm-up: first-token costs, the tokenizer index
    warm = attacker_params(args, "cached", 0)
    with contextlib.suppress(ValueError):
        await engine.add_request(ATTACKER_PROMPT, warm[0])  # the cached schema: compiled once
    for rotation in range(args.repeat):
        order = MODES if rotation % 2 == 0 else tuple(reversed(MODES))
        prepared = {mode: attacker_params(args, mode, rotation) for mode in order}
        for mode in order:
            mx.clear_cache()
            tokens_per_second, attack = await one_run(engine, args, mode, prepared[mode])
            results.tokens_per_second[mode].append(tokens_per_second)
            results.attacks[mode].append(attack)
            print(f"  rotation {rotation} {mode}: victim {tokens_per_second:.1f} tok/s", flush=True)


def format_report(results: Results, args: argparse.Namespace, sizes: str) -> str:
    lines = [
        f"hostile schema: {args.kind} ({sizes}); limits: max_schema_bytes "
        f"{args.max_schema_bytes}, max_grammar_compile_ms {args.max_grammar_compile_ms}, "
        f"max_mask_us {args.max_mask_us}",
        f"victim decode tok/s alone: median {statistics.median(results.alone()):.1f}",
        "mode     victim/alone (median, min..max)   attacker requests: started, finished, refused",
    ]
    for mode in MODES[1:]:
        ratios = results.ratios(mode)
        attacks = results.attacks[mode]
        refused: dict[str, int] = {}
        for attack in attacks:
            for name, count in attack.refused.items():
                refused[name] = refused.get(name, 0) + count
        lines.append(
            f"{mode:<8} {statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
            f"{'':<20}{sum(a.started for a in attacks)}, {sum(a.finished for a in attacks)}, "
            f"{refused or 0}"
        )
    return "\n".join(lines)


def run_hostile_bench(args: argparse.Namespace) -> int:
    if args.kind not in KINDS:
        raise SystemExit(f"--kind must be one of {', '.join(KINDS)}")
    model, tokenizer = load_model(args.model)
    args.victim_prompt = victim_prompt(tokenizer)
    defaults = GrammarLimits()  # the worker's, where a flag is not given
    for name in ("max_schema_bytes", "max_grammar_compile_ms", "max_mask_us"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
    limits = GrammarLimits(
        max_schema_bytes=args.max_schema_bytes,
        max_grammar_compile_ms=args.max_grammar_compile_ms,
        max_mask_us=args.max_mask_us,
    )
    engine = bench_engine(
        args.model, model, tokenizer, max_num_seqs=args.attackers + 1, grammar_limits=limits
    )
    sample = hostile_schema(args.kind, "size")
    sizes = f"{schema_bytes(sample) / 1024:.0f} KiB as compact JSON"
    print(
        f"model {args.model}, {args.attackers} attacker requests in flight, victim max_tokens "
        f"{args.max_tokens}, {args.repeat} rotations, device {mx.default_device()}",
        flush=True,
    )
    results = Results()

    run_on_engine(engine, lambda: run_modes(engine, args, results))
    print(format_report(results, args, sizes))
    stats = engine.scheduler.grammars.stats
    print(
        f"grammars: compiled {stats.compiled}, cache hits {stats.cache_hits}, matchers built "
        f"{stats.matchers_built}, copies {stats.matcher_copies}, slow masks {stats.slow_masks}, "
        f"over limit {stats.over_limit}"
    )
    return 0
