"""``mlx-worker bench embeddings``: the embedding engine against mlx-embeddings called directly.

Both embed the same ``--inputs`` texts (generated sentences, ``--words`` words each) with the
same loaded model, in one process, rotation after rotation (direct, engine, direct, engine …)
so drift hits both alike:

- **direct**: ``mlx_embeddings.generate(model, tokenizer, texts)`` (the library's own batch:
  its tokenizer pads the texts to the longest), ``--batch`` texts a call, one call after
  another; batch 1 is a call per text.
- **engine**: ``EmbeddingEngineCore`` with ``--batch`` requests of one text each in flight
  (a new one queued as each ends); batch 1 is one request after another. At 64, the engine's
  scheduler batches the 64 requests' inputs into each forward pass: continuous batching of
  requests, as a worker runs them.

Reported per batch size: inputs per second of each (median over the rotations) and the
process's CPU milliseconds per input (every thread's: the engine thread's, the event loop's, the
tokenizer's, MLX's and OpenBLAS's), with the ratio engine / direct of each; and the batching
gain of each (the largest batch over batch 1, in inputs/s and in CPU per input). On a shared,
loaded machine the wall figures move with the load; the CPU time is the work each way did,
which the load changes far less. Ratios are medians of the per-rotation ratios (the two figures
of a ratio measured next to each other), which a machine whose speed drifts between rotations
leaves fair.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_redis_worker.engine.embedding_engine import EmbeddingEngineCore
from mlx_redis_worker.engine.embedding_model import EmbeddingModel
from mlx_redis_worker.models.embedding import load_embedding_model
from mlx_redis_worker.models.tiny_tokenizer import WORDS

DIRECT, ENGINE = "direct", "engine"


@dataclass(slots=True)
class Measured:
    """Inputs per second and CPU seconds per input of each way and batch size, one figure per
    rotation."""

    rates: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def add(self, way: str, batch: int, rate: float, cpu_per_input: float) -> None:
        self.rates.setdefault((way, batch), []).append(rate)
        self.cpu.setdefault((way, batch), []).append(cpu_per_input)

    def median(self, way: str, batch: int) -> float:
        return statistics.median(self.rates[(way, batch)])

    def median_cpu(self, way: str, batch: int) -> float:
        return statistics.median(self.cpu[(way, batch)])

    def ratio(self, top: tuple[str, int], bottom: tuple[str, int]) -> float:
        """The median of the per-rotation ratios of inputs/s, ``top / bottom``."""
        pairs = zip(self.rates[top], self.rates[bottom], strict=True)
        return statistics.median(a / b for a, b in pairs)

    def cpu_ratio(self, top: tuple[str, int], bottom: tuple[str, int]) -> float:
        """The median of the per-rotation ratios of CPU per input, ``bottom / top``: like
        ``ratio``, above 1 when ``top`` does the work for less."""
        pairs = zip(self.cpu[top], self.cpu[bottom], strict=True)
        return statistics.median(b / a for a, b in pairs)


def cpu_seconds() -> float:
    """This process's CPU time, every thread's: the work a way did, which a loaded machine's
    wall time does not show alone."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_texts(count: int, words: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(count)
    ]


def direct_rate(model: EmbeddingModel, texts: list[str], batch: int) -> float:
    """Inputs per second of mlx-embeddings' own ``generate``, ``batch`` texts a call."""
    from mlx_embeddings import generate

    started = time.perf_counter()
    for start in range(0, len(texts), batch):
        output = generate(model.model, model.tokenizer, texts=texts[start : start + batch])
        mx.eval(output.text_embeds)
    return len(texts) / (time.perf_counter() - started)


async def engine_rate(engine: EmbeddingEngineCore, texts: list[str], batch: int) -> float:
    """Inputs per second of the engine with ``batch`` one-text requests in flight."""
    pending: list[str | list[int]] = list(reversed(texts))

    async def client() -> None:
        while pending:
            result = await engine.embed([pending.pop()])
            assert len(result.vectors) == 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(batch)))
    return len(texts) / (time.perf_counter() - started)


def measure(args: argparse.Namespace, log: Callable[[str], None] = print) -> Measured:
    model = load_embedding_model(args.model)
    texts = make_texts(args.inputs, args.words)
    batches = sorted(set(args.batch))
    measured = Measured()

    async def run() -> None:
        engine = EmbeddingEngineCore(model)
        try:
            await engine.embed(list(texts[:8]))  # warm-up of both (first passes are slower)
            direct_rate(model, texts[:8], 8)
            for rotation in range(args.repeat):
                for batch in batches:
                    # Fewer texts at batch 1: it is the slow end, and its rate is steady.
                    sample = texts if batch > 1 else texts[: max(len(texts) // 4, 8)]
                    before = cpu_seconds()
                    rate = direct_rate(model, sample, batch)  # this thread: the engine idles
                    measured.add(DIRECT, batch, rate, (cpu_seconds() - before) / len(sample))
                    before = cpu_seconds()
                    rate = await engine_rate(engine, sample, batch)
                    measured.add(ENGINE, batch, rate, (cpu_seconds() - before) / len(sample))
                    log(
                        f"rotation {rotation + 1}: batch {batch}: direct "
                        f"{measured.rates[(DIRECT, batch)][-1]:.1f}, engine {rate:.1f} inputs/s; "
                        f"CPU ms an input: direct {measured.cpu[(DIRECT, batch)][-1] * 1e3:.2f}, "
                        f"engine {measured.cpu[(ENGINE, batch)][-1] * 1e3:.2f}"
                    )
        finally:
            engine.close()

    asyncio.run(run())
    return measured


def format_embeddings(measured: Measured, args: argparse.Namespace) -> str:
    batches = sorted(set(args.batch))
    lines = [
        f"bench embeddings: model {args.model}, {args.inputs} inputs of {args.words} words, "
        f"{args.repeat} rotations (medians), load average "
        + " ".join(f"{value:.2f}" for value in os.getloadavg()),
        f"{'batch':>6} {'direct in/s':>12} {'engine in/s':>12} {'engine / direct':>16}"
        f" {'direct CPU ms/in':>17} {'engine CPU ms/in':>17} {'by CPU':>7}",
    ]
    for batch in batches:
        direct, engine = measured.median(DIRECT, batch), measured.median(ENGINE, batch)
        paired = measured.ratio((ENGINE, batch), (DIRECT, batch))
        direct_cpu = measured.median_cpu(DIRECT, batch) * 1e3
        engine_cpu = measured.median_cpu(ENGINE, batch) * 1e3
        by_cpu = measured.cpu_ratio((ENGINE, batch), (DIRECT, batch))
        lines.append(
            f"{batch:>6} {direct:>12.1f} {engine:>12.1f} {paired:>16.2f}"
            f" {direct_cpu:>17.3f} {engine_cpu:>17.3f} {by_cpu:>7.2f}"
        )
    low, high = batches[0], batches[-1]
    for way in (ENGINE, DIRECT):
        gain = measured.ratio((way, high), (way, low))
        by_cpu = measured.cpu_ratio((way, high), (way, low))
        lines.append(
            f"batching gain, {way}: {gain:.2f}x in inputs/s, {by_cpu:.2f}x in CPU per input "
            f"(batch {high} over batch {low})"
        )
    return "\n".join(lines)


def run_embeddings_bench(args: argparse.Namespace) -> int:
    measured = measure(args)
    print(format_embeddings(measured, args))
    return 0
