"""Speculative decoding on an NVIDIA GPU (MLX's CUDA backend): what verifying drafts costs per
extra token, and what prompt lookup buys through the engine.

Random-weight models of real shapes (gpu_bench.py's), bf16:

1. **Verify cost.** One forward pass of ``w`` positions per row (the pending token plus
   ``w - 1`` drafts) over a KV cache of ``--context`` tokens, for each batch and width, the
   greedy tokens read back on the host as the engine does: ms per pass, its ratio to ``w = 1``,
   and the cost of each extra position. Drafting pays at batch ``B`` while ``1 + accepted``
   tokens per pass outweigh that ratio; this is the figure random weights cannot spoil.
2. **Through the engine.** ``EngineCore`` with and without prompt lookup on prompts that hold
   the model's own greedy continuation (prompt ``P + G + P``, where ``G`` is the greedy output
   after ``P``): random weights accept drafts only where the output repeats its input, so this
   is the one input-grounded case they have. Decode tok/s per path (alternating), the
   acceptance the engine saw, and whether greedy outputs are equal token for token; batch 1 and
   a batch above ``speculative_max_batch``, where the engine must back off by itself.

Run by ops/gpu/run.sh with ``GPU_BENCH=speculative_gpu``; prints markdown tables and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import SHAPES, _median, build_model, prompts, word_tokenizer

from mlx_redis_worker.engine import (
    EngineConfig,
    EngineCore,
    SamplingParams,
    SchedulerConfig,
    SpeculativeParams,
)


def verify_pass_ms(model: Any, batch: int, width: int, context: int, repeat: int) -> float:
    """Median ms of one pass of ``width`` positions per row over a ``context``-token cache."""
    vocab = model.args.vocab_size
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompts(batch, context, vocab, 7)), cache=cache))
    drafts = mx.array(prompts(batch, width, vocab, 11))
    times = []
    for _ in range(repeat + 3):
        start = time.perf_counter()
        logits = model(drafts, cache=cache)
        mx.argmax(logits, axis=-1).tolist()  # the host needs the tokens, as every step does
        times.append(time.perf_counter() - start)
        for layer in cache:
            layer.trim(width)
    del cache
    times = sorted(times[3:])
    return 1e3 * times[len(times) // 2]


def grounded_prompts(engine: EngineCore, batch: int, length: int, vocab: int, tokens: int) -> Any:
    """``P + G + P`` per row, G being the greedy continuation of P."""
    seeds = prompts(batch, length, vocab, 1000 + batch)
    outputs = engine.generate_batch_sync(seeds, SamplingParams(max_tokens=tokens, temperature=0.0))
    by_prompt = [list(o.output_token_ids) for o in outputs]
    return [p + g + p for p, g in zip(seeds, by_prompt, strict=True)]


def engine_run(
    engine: EngineCore, batch: list[list[int]], max_tokens: int, draft: int
) -> tuple[float, list[list[int]]]:
    """Decode tok/s (tokens after each first, from the first first token to the end) and the
    outputs, through add_request + stream_outputs."""
    speculative = SpeculativeParams(num_draft_tokens=draft) if draft else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=speculative)

    async def scenario() -> tuple[float, list[list[int]]]:
        first: list[float] = []

        async def consume(request_id: str) -> list[int]:
            tokens: list[int] = []
            async for output in engine.stream_outputs(request_id):
                if output.new_token_ids and not first:
                    first.append(time.perf_counter())
                tokens += output.new_token_ids
            return tokens

        ids = [await engine.add_request(prompt, params) for prompt in batch]
        outs = await asyncio.gather(*(consume(request_id) for request_id in ids))
        end = time.perf_counter()
        generated = sum(len(o) for o in outs) - len(batch)
        return generated / (end - first[0]), list(outs)

    return asyncio.run(scenario())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.5B,8B")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--widths", default="1,2,3,5,9")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--engine-batches", default="1,32")
    parser.add_argument("--engine-repeat", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"device {mx.default_device()}, {json.dumps(mx.device_info())}", flush=True)
    widths = [int(w) for w in args.widths.split(",")]
    verify_rows, engine_rows = [], []
    for name in args.shapes.split(","):
        model, _ = build_model(SHAPES[name])
        vocab = SHAPES[name]["vocab_size"]
        verify_pass_ms(model, 1, 1, 16, 2)  # kernels built once
        for batch in (int(b) for b in args.batches.split(",")):
            base = None
            for width in widths:
                ms = verify_pass_ms(model, batch, width, args.context, args.repeat)
                base = ms if width == 1 else base
                assert base is not None
                row = {
                    "shape": name,
                    "batch": batch,
                    "width": width,
                    "ms": ms,
                    "ratio": ms / base,
                    "us_per_extra": 1e3 * (ms - base) / (width - 1) if width > 1 else 0.0,
                }
                verify_rows.append(row)
                print(json.dumps(row), flush=True)
            mx.clear_cache()
        engine_batches = [int(b) for b in args.engine_batches.split(",")]
        config = SchedulerConfig(
            max_num_seqs=max(engine_batches),
            prefill_batch_size=max(engine_batches),
            enable_prefix_cache=False,
        )
        engine = EngineCore(model, word_tokenizer(vocab), EngineConfig(scheduler_config=config))
        warm = prompts(2, 32, vocab, 0)
        engine_run(engine, warm, 8, 0)
        engine_run(engine, warm, 8, args.draft)
        for batch in engine_batches:
            data = grounded_prompts(engine, batch, 32, vocab, args.max_tokens)
            before = engine.stats().scheduler.speculation
            rates: dict[str, list[float]] = {"plain": [], "speculative": []}
            outputs: dict[str, list[list[int]]] = {}
            for rotation in range(args.engine_repeat):
                order = ("plain", "speculative") if rotation % 2 == 0 else ("speculative", "plain")
                for path in order:
                    mx.clear_cache()
                    draft = args.draft if path == "speculative" else 0
                    rate, outs = engine_run(engine, data, args.max_tokens, draft)
                    rates[path].append(rate)
                    outputs.setdefault(path, outs)
            after = engine.stats().scheduler.speculation
            drafted = after.draft_tokens - before.draft_tokens
            accepted = after.accepted_tokens - before.accepted_tokens
            steps_rows = after.rows - before.rows
            row = {
                "shape": name,
                "batch": batch,
                "plain_tok_s": _median(rates["plain"]),
                "speculative_tok_s": _median(rates["speculative"]),
                "ratio": _median(
                    [s / p for s, p in zip(rates["speculative"], rates["plain"], strict=True)]
                ),
                "acceptance": accepted / drafted if drafted else 0.0,
                "tokens_per_step": (steps_rows + accepted) / steps_rows if steps_rows else 0.0,
                "batch_backoffs": after.batch_backoffs - before.batch_backoffs,
                "equal": outputs["plain"] == outputs["speculative"],
                "plain_all": rates["plain"],
                "speculative_all": rates["speculative"],
            }
            engine_rows.append(row)
            print(json.dumps(row), flush=True)
        engine.close()
        del model, engine
        mx.clear_cache()
    print()
    print("| shape | batch | width | pass ms | / width 1 | µs per extra position |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in verify_rows:
        print(
            f"| {r['shape']} | {r['batch']} | {r['width']} | {r['ms']:.2f} | {r['ratio']:.3f} "
            f"| {r['us_per_extra']:.0f} |"
        )
    print()
    print(
        "| shape | batch | plain tok/s | speculative tok/s | speculative / plain | acceptance |"
        " tokens per verify step | batch backoffs | greedy outputs equal |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in engine_rows:
        print(
            f"| {r['shape']} | {r['batch']} | {r['plain_tok_s']:.0f} "
            f"| {r['speculative_tok_s']:.0f} | {r['ratio']:.3f} | {r['acceptance']:.2f} "
            f"| {r['tokens_per_step']:.2f} | {r['batch_backoffs']} "
            f"| {'yes' if r['equal'] else 'no'} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"verify": verify_rows, "engine": engine_rows}, handle, indent=1)


if __name__ == "__main__":
    main()
