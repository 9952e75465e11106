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

Reported per batch size: inputs per second of each (median over the rotations) and the ratio
engine / direct; and the batching gain of each (inputs/s at the largest batch over batch 1).
Ratios are medians of the per-rotation ratios (the two figures of a ratio measured next to
each other), which a machine whose speed drifts between rotations leaves fair.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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
    """Inputs per second of each way and batch size, one figure per rotation."""

    rates: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def add(self, way: str, batch: int, rate: float) -> None:
        self.rates.setdefault((way, batch), []).append(rate)

    def median(self, way: str, batch: int) -> float:
        return statistics.median(self.rates[(way, batch)])

    def ratio(self, top: tuple[str, int], bottom: tuple[str, int]) -> float:
        """The median of the per-rotation ratios ``top / bottom``."""
        pairs = zip(self.rates[top], self.rates[bottom], strict=True)
        return statistics.median(a / b for a, b in pairs)


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
                    rate = direct_rate(model, sample, batch)  # this thread: the engine idles
                    measured.add(DIRECT, batch, rate)
                    measured.add(ENGINE, batch, await engine_rate(engine, sample, batch))
                    log(
                        f"rotation {rotation + 1}: batch {batch}: direct {rate:.1f}, engine "
                        f"{measured.rates[(ENGINE, batch)][-1]:.1f} inputs/s"
                    )
        finally:
            engine.close()

    asyncio.run(run())
    return measured


def format_embeddings(measured: Measured, args: argparse.Namespace) -> str:
    batches = sorted(set(args.batch))
    lines = [
        f"bench embeddings: model {args.model}, {args.inputs} inputs of {args.words} words, "
        f"{args.repeat} rotations (medians), load average {os.getloadavg()[0]:.2f}",
        f"{'batch':>6} {'direct in/s':>12} {'engine in/s':>12} {'engine / direct':>16}",
    ]
    for batch in batches:
        direct, engine = measured.median(DIRECT, batch), measured.median(ENGINE, batch)
        paired = measured.ratio((ENGINE, batch), (DIRECT, batch))
        lines.append(f"{batch:>6} {direct:>12.1f} {engine:>12.1f} {paired:>16.2f}")
    low, high = batches[0], batches[-1]
    for way in (ENGINE, DIRECT):
        gain = measured.ratio((way, high), (way, low))
        lines.append(f"batching gain, {way}: {gain:.2f}x (batch {high} over batch {low})")
    return "\n".join(lines)


def run_embeddings_bench(args: argparse.Namespace) -> int:
    measured = measure(args)
    print(format_embeddings(measured, args))
    return 0
