"""``mlx-worker bench speculative``: speculative decoding against plain decoding, one run.

Input-grounded prompts (edit this code, quote from this text, fill this JSON), with the
model's chat template, greedy:

- batch 1: each prompt alone, plain then speculative (``--method``: prompt lookup, or a draft
  model named by ``--draft-model``, e.g. ``smollm2-draft``), alternating over
  ``--repeat`` rotations after a warm-up of each. The speedup is decode tok/s (tokens 2..N of
  each request over the time from its first token to its last; prefill is the same work on both
  paths) summed over the prompts, speculative over plain; the outputs must be equal token for
  token.
- batch ``--batch``: that many requests added together (the prompts in turn), plain then
  speculative, tok/s of the whole batch (all tokens over the wall time): the engine must back
  off by itself where verifying drafts does not pay.

The last line is ``speculative speedup at B=1: X.XX (greedy outputs equal: yes|no)``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_redis_worker.engine import (
    EngineConfig,
    EngineCore,
    SamplingParams,
    SchedulerConfig,
    SpeculativeParams,
)
from mlx_redis_worker.engine.config import DraftModel
from mlx_redis_worker.engine.stats import MethodStats, SpeculationStats
from mlx_redis_worker.models import load_model

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax


def describe(items):
    lines = []
    for item in items:
        lines.append(f"{item['name']}: {item['quantity']} x {item['price']}")
    return "\\n".join(lines)
"""

TEXT = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper "
    "climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the lens. "
    "Ships that passed the headland learned to trust its slow white flash, and fishermen set "
    "their courses by it when the fog rolled in from the sea. When the keeper grew old, his "
    "daughter took over the work, and she kept the light burning through the great storm of "
    "the winter the harbour froze."
)

ASKS = [
    f"Copy this code exactly, changing only the name subtotal to net:\n\n{CODE}",
    f"Add a docstring to each function of this code and return the whole code:\n\n{CODE}",
    f"Quote the first two sentences of this text exactly:\n\n{TEXT}",
    f"Repeat this text, replacing 'keeper' with 'warden':\n\n{TEXT}",
    "Fill in this JSON for the lighthouse in the text below, keeping the keys:\n"
    '{"location": "", "age_years": 0, "signal": "", "keepers": [], "storm": ""}\n\n' + TEXT,
    "Convert this list to JSON with the keys name, quantity and price:\n"
    "- apples, 3, 0.5\n- bread, 1, 2.25\n- milk, 2, 1.1\n- eggs, 12, 0.3\n- rice, 1, 3.4",
]

PLAIN, SPECULATIVE = "plain", "speculative"


@dataclass(slots=True)
class Finished:
    tokens: list[int]
    arrivals: list[float]  # when each token reached the caller
    started: float

    @property
    def decode_tokens(self) -> int:
        return max(len(self.tokens) - 1, 0)

    @property
    def decode_seconds(self) -> float:
        return self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0


async def _run(engine: EngineCore, prompts: list[str], params: SamplingParams) -> list[Finished]:
    started = time.perf_counter()
    ids = [await engine.add_request(p, params) for p in prompts]

    async def one(request_id: str) -> Finished:
        tokens: list[int] = []
        arrivals: list[float] = []
        async for output in engine.stream_outputs(request_id):
            now = time.perf_counter()
            tokens += output.new_token_ids
            arrivals += [now] * len(output.new_token_ids)
        return Finished(tokens, arrivals, started)

    return list(await asyncio.gather(*(one(r) for r in ids)))


def _params(path: str, max_tokens: int, draft: int, method: str) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        speculative=SpeculativeParams(method=method, num_draft_tokens=draft)  # type: ignore[arg-type]
        if path == SPECULATIVE
        else None,
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _describe(stats: SpeculationStats) -> str:
    return (
        f"{stats.steps} verify steps, {stats.draft_tokens} drafts, acceptance "
        f"{stats.acceptance_rate:.2f}, {stats.tokens_per_step:.2f} tokens per step, "
        f"{stats.backoffs} backoffs, {stats.batch_backoffs} batch backoffs"
    )


async def _bench(args: argparse.Namespace, engine: EngineCore, prompts: list[str]) -> int:
    draft = args.num_draft_tokens
    await engine.start()
    # Warm-up: both paths once (MLX builds its kernels on first use).
    for path in (PLAIN, SPECULATIVE):
        await _run(engine, prompts[:1], _params(path, 16, draft, args.method))

    # Batch 1, prompt by prompt, A B alternating over the rotations.
    decode = {PLAIN: [0, 0.0], SPECULATIVE: [0, 0.0]}
    outputs: dict[str, dict[int, list[int]]] = {PLAIN: {}, SPECULATIVE: {}}
    before = engine.stats().scheduler.speculation
    for rotation in range(args.repeat):
        order = (PLAIN, SPECULATIVE) if rotation % 2 == 0 else (SPECULATIVE, PLAIN)
        for index, prompt in enumerate(prompts):
            for path in order:
                (done,) = await _run(
                    engine, [prompt], _params(path, args.max_tokens, draft, args.method)
                )
                decode[path][0] += done.decode_tokens
                decode[path][1] += done.decode_seconds
                outputs[path].setdefault(index, done.tokens)
    after = engine.stats().scheduler.speculation
    rates = {path: _ratio(decode[path][0], decode[path][1]) for path in decode}
    equal = all(outputs[PLAIN][i] == outputs[SPECULATIVE][i] for i in outputs[PLAIN])
    for index in outputs[PLAIN]:
        same = "equal" if outputs[PLAIN][index] == outputs[SPECULATIVE][index] else "DIFFERENT"
        print(f"  prompt {index}: {len(outputs[PLAIN][index])} tokens, outputs {same}", flush=True)
    print(
        f"batch 1: plain {rates[PLAIN]:.1f} tok/s, speculative {rates[SPECULATIVE]:.1f} tok/s "
        f"(decode, {args.repeat} rotations of {len(prompts)} prompts)"
    )
    print(f"  speculation: {_describe(_since(before, after))}", flush=True)

    # Batch N: all requests at once, plain then speculative, then once more in reverse.
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    if not batch:  # --batch 0: batch 1 only
        return await _finish(engine, rates, equal)
    totals = {PLAIN: [0, 0.0], SPECULATIVE: [0, 0.0]}
    before = engine.stats().scheduler.speculation
    for path in (PLAIN, SPECULATIVE, SPECULATIVE, PLAIN):
        started = time.perf_counter()
        finished = await _run(
            engine, batch, _params(path, args.batch_max_tokens, draft, args.method)
        )
        totals[path][0] += sum(len(f.tokens) for f in finished)
        totals[path][1] += time.perf_counter() - started
    after = engine.stats().scheduler.speculation
    batch_rates = {path: _ratio(totals[path][0], totals[path][1]) for path in totals}
    print(
        f"batch {args.batch}: plain {batch_rates[PLAIN]:.1f} tok/s, speculative "
        f"{batch_rates[SPECULATIVE]:.1f} tok/s, ratio "
        f"{_ratio(batch_rates[SPECULATIVE], batch_rates[PLAIN]):.2f} (goal >= 0.95)"
    )
    print(f"  speculation: {_describe(_since(before, after))}")
    return await _finish(engine, rates, equal)


async def _finish(engine: EngineCore, rates: dict[str, float], equal: bool) -> int:
    await engine.stop()
    speedup = _ratio(rates[SPECULATIVE], rates[PLAIN])
    print(
        f"speculative speedup at B=1: {speedup:.2f} "
        f"(greedy outputs equal: {'yes' if equal else 'no'})"
    )
    return 0 if equal else 1


def _since(before: SpeculationStats, after: SpeculationStats) -> SpeculationStats:
    rows = after.rows - before.rows
    drafted = after.draft_tokens - before.draft_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    return SpeculationStats(
        steps=after.steps - before.steps,
        rows=rows,
        draft_tokens=drafted,
        accepted_tokens=accepted,
        backoffs=after.backoffs - before.backoffs,
        batch_backoffs=after.batch_backoffs - before.batch_backoffs,
        acceptance_rate=_ratio(accepted, drafted),
        tokens_per_step=_ratio(rows + accepted, rows),
        prompt_lookup=_method_since(before.prompt_lookup, after.prompt_lookup),
        draft_model=_method_since(before.draft_model, after.draft_model),
    )


def _method_since(before: MethodStats, after: MethodStats) -> MethodStats:
    return MethodStats.of(
        after.steps - before.steps,
        after.rows - before.rows,
        after.draft_tokens - before.draft_tokens,
        after.accepted_tokens - before.accepted_tokens,
    )


def chat_prompts(tokenizer: Any) -> list[str]:
    if getattr(tokenizer, "chat_template", None):
        return [
            str(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
                )
            )
            for ask in ASKS
        ]
    return list(ASKS)


def run_speculative_bench(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model)
    prompts = chat_prompts(tokenizer)[: args.prompts]
    config = SchedulerConfig(max_num_seqs=max(args.batch, 1), enable_prefix_cache=False)
    draft = None
    if args.method == "draft_model":
        if not args.draft_model:
            raise SystemExit(
                "mlx-worker bench speculative: --method draft_model needs --draft-model"
            )
        draft = DraftModel(args.draft_model, *load_model(args.draft_model))
    engine = EngineCore(
        model,
        tokenizer,
        EngineConfig(model_name=args.model, scheduler_config=config, draft=draft),
    )
    source = "prompt lookup" if draft is None else f"draft model {args.draft_model}"
    print(
        f"model {args.model}, {len(prompts)} prompts, max_tokens {args.max_tokens}, "
        f"{args.num_draft_tokens} draft tokens ({source}), {args.repeat} rotations, "
        f"batch {args.batch} x {args.batch_max_tokens} tokens, device {mx.default_device()}",
        flush=True,
    )
    try:
        return asyncio.run(_bench(args, engine, prompts))
    finally:
        engine.close()
