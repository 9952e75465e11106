"""``mlx-worker bench vision``: image requests through our engine against mlx-vlm, same run.

N requests, each a different picture with the same question, arrive together (t0), greedy, on
three paths: mlx-vlm's ``stream_generate`` one request after another (what a loop over files
does), mlx-vlm's ``BatchGenerator`` driven directly (each request's images processed and
encoded with mlx-vlm's own ``get_input_embeddings``, then all inserted and stepped), and our
engine (``add_request`` with the images, then ``stream_outputs``; the prefix cache off so no
path reuses another's prompts). Both batched paths get decode and prefill batches of N (as
mlx-vlm's own ``batch_generate`` sets them). Every path's time includes the image processing
and the vision encoding. Reported: generated tokens per second of wall time, the time to
first token from t0 (p50, p95) and the process's CPU time per token (every thread's: on a
loaded machine the work done, where wall time also shows the waiting), the paths in rotation
(A B C A B C ...) so drift hits each alike, and the ratios of each rotation (median over
rotations).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_redis_worker.bench.engine_bench import PathResult, _percentile, drain
from mlx_redis_worker.engine import EngineConfig, EngineCore, SamplingParams, SchedulerConfig
from mlx_redis_worker.engine.vision import VisionModel, vision_model_of
from mlx_redis_worker.models import load_model

QUESTION = "Describe this picture in detail."
SEQUENTIAL = "mlx-vlm stream_generate (one after another)"
BATCH = "mlx-vlm BatchGenerator"
ENGINE = "engine add_request + stream_outputs"


def pictures(count: int, width: int, height: int, seed: int) -> list[Any]:
    """``count`` different RGB pictures of random pixels (each its own generator)."""
    from PIL import Image

    return [
        Image.fromarray(
            np.random.default_rng(seed + i).integers(0, 256, (height, width, 3), dtype=np.uint8)
        )
        for i in range(count)
    ]


def question_prompt(tokenizer: Any, placeholder: str) -> str:
    """The question as the model's chat template renders a user turn with one picture."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}
    ]
    rendered: str = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return rendered if placeholder in rendered else placeholder + rendered


def run_sequential(vision: VisionModel, prompt: str, images: list[Any], limit: int) -> PathResult:
    from mlx_vlm import stream_generate

    ttfts: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for image in images:
        responses = stream_generate(
            vision.vlm, vision.processor, prompt, image=[image], max_tokens=limit, temperature=0.0
        )
        first = next(responses)
        ttfts.append(time.perf_counter() - start)
        last = first
        for last in responses:  # noqa: B007  # the last one counts the tokens
            pass
        tokens += last.generation_tokens
    return PathResult(SEQUENTIAL, len(images), tokens, time.perf_counter() - start, ttfts)


def run_batch_generator(
    vision: VisionModel, prompt: str, images: list[Any], limit: int, config: SchedulerConfig
) -> PathResult:
    """mlx-vlm's ``BatchGenerator`` with the engine's batch sizes (both N here, as mlx-vlm's
    own ``batch_generate`` sets them), each request's inputs made by its processor and its
    model's ``get_input_embeddings``."""
    from mlx_vlm.generate.ar import BatchGenerator

    generator = BatchGenerator(
        vision.vlm.language_model,
        vision.processor,
        prefill_batch_size=config.prefill_batch_size,
        completion_batch_size=config.max_num_seqs,
        prefill_step_size=config.prefill_step_size,
        compute_logprobs=False,
    )
    start = time.perf_counter()
    uids = []
    for image in images:
        inputs = vision.processor(text=[prompt], images=[[image]])
        rest = {
            k: v
            for k, v in inputs.items()
            if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        embedded = vision.vlm.get_input_embeddings(
            inputs["input_ids"], inputs["pixel_values"], mask=inputs["attention_mask"], **rest
        )
        extra = {k: v for k, v in embedded.to_dict().items() if v is not None}
        uids += generator.insert(
            inputs["input_ids"],
            [limit],
            prompt_kwargs=[{**rest, **extra}],
            attention_mask=inputs["attention_mask"],
        )
    tokens, ttfts = drain(generator, uids, start)
    seconds = time.perf_counter() - start
    generator.close()
    return PathResult(BATCH, len(images), tokens, seconds, ttfts)


def run_engine(engine: EngineCore, prompt: str, images: list[Any], limit: int) -> PathResult:
    params = SamplingParams(max_tokens=limit, temperature=0.0)

    async def burst() -> PathResult:
        start = time.perf_counter()
        first_token: list[float] = []
        tokens = 0

        async def one(image: Any) -> None:
            nonlocal tokens
            rid = await engine.add_request(prompt, params, images=[image])
            async for output in engine.stream_outputs(rid):
                if output.new_token_ids and tokens_of(rid) == 0:
                    first_token.append(time.perf_counter() - start)
                counted[rid] = tokens_of(rid) + len(output.new_token_ids)
                tokens += len(output.new_token_ids)

        counted: dict[str, int] = {}

        def tokens_of(rid: str) -> int:
            return counted.get(rid, 0)

        await asyncio.gather(*(one(image) for image in images))
        seconds = time.perf_counter() - start
        await engine.stop()
        return PathResult(ENGINE, len(images), tokens, seconds, first_token)

    return asyncio.run(burst())


def run_vision_bench(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args.model)
    vision = vision_model_of(model)
    if vision is None:
        print(f"mlx-worker: {args.model} is not a vision-language model")
        return 2
    width, height = (int(side) for side in args.image_size.split("x"))
    prompt = question_prompt(tokenizer, vision.image_placeholder)
    config = SchedulerConfig(
        max_num_seqs=args.concurrency,
        prefill_batch_size=args.concurrency,
        enable_prefix_cache=False,
    )
    engine = EngineCore(
        model, tokenizer, EngineConfig(model_name=args.model, scheduler_config=config)
    )
    paths: list[Callable[[list[Any]], PathResult]] = [
        lambda images: run_sequential(vision, prompt, images, args.max_tokens),
        lambda images: run_batch_generator(vision, prompt, images, args.max_tokens, config),
        lambda images: run_engine(engine, prompt, images, args.max_tokens),
    ]
    print(_describe(args, prompt, tokenizer))
    warmup = pictures(2, width, height, seed=10_000)
    for run_path in paths:
        run_path(warmup)
    runs: list[list[PathResult]] = [[] for _ in paths]
    cpu: list[list[float]] = [[] for _ in paths]  # the process's CPU seconds per token
    try:
        for rotation in range(args.repeat):
            images = pictures(args.concurrency, width, height, seed=rotation * 100)
            for index, run_path in enumerate(paths):
                before = _cpu_seconds()
                result = run_path(images)
                cpu[index].append((_cpu_seconds() - before) / max(result.tokens, 1))
                runs[index].append(result)
                mx.clear_cache()
    finally:
        engine.close()
    print(format_table(runs, cpu))
    print(format_ratios(runs, cpu))
    print(f"load average after: {_load()}")
    return 0


def _describe(args: argparse.Namespace, prompt: str, tokenizer: Any) -> str:
    return (
        f"bench vision: model {args.model}, {args.concurrency} requests at once, each a "
        f"{args.image_size} picture and {len(tokenizer.encode(prompt))} text tokens, "
        f"max {args.max_tokens} tokens greedy, {args.repeat} rotations; load average "
        f"before: {_load()}"
    )


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _cpu_seconds() -> float:
    """This process's CPU time, every thread's (the engine's, the loop's, MLX's): the work a
    path did, which a loaded machine's wall time does not show alone."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def format_table(runs: list[list[PathResult]], cpu: list[list[float]]) -> str:
    lines = [
        "| path | tokens | tok/s (min–max) | TTFT p50 (ms) | TTFT p95 (ms) | CPU ms/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for repeats, cpu_per_token in zip(runs, cpu, strict=True):
        speeds = [r.tokens_per_second for r in repeats]
        lines.append(
            f"| {repeats[0].path} | {repeats[0].tokens} | "
            f"{statistics.median(speeds):.1f} ({min(speeds):.1f}–{max(speeds):.1f}) | "
            f"{statistics.median([_percentile(r.ttfts, 0.5) for r in repeats]) * 1e3:.0f} | "
            f"{statistics.median([_percentile(r.ttfts, 0.95) for r in repeats]) * 1e3:.0f} | "
            f"{statistics.median(cpu_per_token) * 1e3:.2f} |"
        )
    return "\n".join(lines)


def format_ratios(runs: list[list[PathResult]], cpu: list[list[float]]) -> str:
    sequential, batch, ours = runs

    def ratio(
        a: list[PathResult], b: list[PathResult], measure: Callable[[PathResult], float]
    ) -> float:
        return statistics.median(measure(x) / measure(y) for x, y in zip(a, b, strict=True))

    def speed(r: PathResult) -> float:
        return r.tokens_per_second

    def ttft_p50(r: PathResult) -> float:
        return _percentile(r.ttfts, 0.5)

    return "\n".join(
        [
            "",
            "Ratios (median of per-rotation ratios, same run):",
            f"  engine / one after another tok/s = {ratio(ours, sequential, speed):.2f} "
            "(goal >= 3)",
            f"  engine / mlx-vlm BatchGenerator tok/s = {ratio(ours, batch, speed):.2f} "
            "(goal >= 0.95)",
            f"  engine / one after another TTFT p50 = {ratio(ours, sequential, ttft_p50):.2f} "
            "(goal <= 1)",
            f"  engine / mlx-vlm BatchGenerator TTFT p50 = {ratio(ours, batch, ttft_p50):.2f}",
            "  engine / mlx-vlm BatchGenerator CPU per token = "
            f"{statistics.median(a / b for a, b in zip(cpu[2], cpu[1], strict=True)):.2f}",
        ]
    )
