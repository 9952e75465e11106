"""Constrained against unconstrained decoding at one batch size, on the GPU (or any device).

A grammar's mask for step n + 1 needs the token sampled at step n, so each constrained
sequence's processor waits for that value: the one cost of structured output that grows with
the device's speed. Random-weight bf16 model of a real shape (see gpu_bench.py) with SmolLM2's
real byte-level BPE tokenizer (``--tokenizer``: llguidance needs real token bytes); ``--batch``
greedy requests of ``--max-tokens`` under a JSON schema that no output completes within them,
so every run makes the same number of tokens; constrained and unconstrained runs alternate
(A B B A ...). Run it under two checkouts' PYTHONPATH to compare them.
"""

from __future__ import annotations

# `mlx_redis_worker` first: on CPU it loads OpenBLAS before anything imports mlx.
import mlx_redis_worker  # noqa: F401  # isort: skip

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from gpu_bench import SHAPES, build_model  # type: ignore[import-not-found]
from mlx_lm.utils import load_tokenizer

from mlx_redis_worker.engine import (
    EngineConfig,
    EngineCore,
    ResponseFormat,
    SamplingParams,
    SchedulerConfig,
)


def tokens_per_second(engine: EngineCore, prompts: list[str], params: SamplingParams) -> float:
    mx.clear_cache()
    start = time.perf_counter()
    outputs = engine.generate_batch_sync(prompts, params)
    seconds = time.perf_counter() - start
    return sum(o.completion_tokens for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="")
    parser.add_argument("--shape", default="0.5B")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokenizer = load_tokenizer(Path(args.tokenizer))
    shape = {**SHAPES[args.shape], "vocab_size": len(tokenizer._tokenizer)}
    model, _ = build_model(shape)
    config = SchedulerConfig(max_num_seqs=args.batch, enable_prefix_cache=False)
    engine = EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))
    prompts = [f"Story {i}: once upon a time" for i in range(args.batch)]
    # A JSON array of at least 10000 integers: a typical JSON mask, never complete in time.
    never_complete = ResponseFormat(
        "json_schema", schema={"type": "array", "items": {"type": "integer"}, "minItems": 10000}
    )
    paths = {
        "unconstrained": SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
        "constrained": SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0, response_format=never_complete
        ),
    }
    for params in paths.values():  # warm-up
        tokens_per_second(engine, prompts, params)
    runs: dict[str, list[float]] = {name: [] for name in paths}
    for rotation in range(args.repeat):
        order = list(paths) if rotation % 2 == 0 else list(reversed(paths))
        for name in order:
            runs[name].append(tokens_per_second(engine, prompts, paths[name]))
    engine.close()
    ratios = [c / u for c, u in zip(runs["constrained"], runs["unconstrained"], strict=True)]
    row = {
        "label": args.label,
        "device": str(mx.default_device()),
        "shape": args.shape,
        "batch": args.batch,
        "constrained": statistics.median(runs["constrained"]),
        "unconstrained": statistics.median(runs["unconstrained"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }
    print(
        f"{args.label} {row['device']} {args.shape} batch {args.batch}: constrained "
        f"{row['constrained']:.0f} tok/s, unconstrained {row['unconstrained']:.0f}, ratio "
        f"{row['ratio']:.3f} (per rotation {min(ratios):.3f}-{max(ratios):.3f})",
        flush=True,
    )
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
