"""The embedding engine: many requests' inputs batched into each forward pass, vectors that
do not depend on the batch, Matryoshka lengths as the model documents them, limits refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from mlx_redis_worker.engine import EngineCore
from mlx_redis_worker.engine.embedding_engine import EmbeddingEngineCore
from mlx_redis_worker.engine.embedding_model import EmbeddingModel
from mlx_redis_worker.engine.embedding_scheduler import EmbeddingLimits
from tests.support.waiting import run

TEXTS = [
    "The river runs under the old stone bridge.",
    "A quiet morning",
    "Seven sailors found a map of the island and sailed for three days in the rain.",
    "bread",
]


def vector(data: bytes) -> np.ndarray[Any, np.dtype[np.float32]]:
    return np.frombuffer(data, dtype="<f4")


@pytest.fixture
def embedder(tiny_embed_model: EmbeddingModel) -> Iterator[Callable[..., EmbeddingEngineCore]]:
    engines: list[EmbeddingEngineCore] = []

    def build(model: EmbeddingModel = tiny_embed_model, **limits: Any) -> EmbeddingEngineCore:
        engine = EmbeddingEngineCore(model, limits=EmbeddingLimits(**limits))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


def test_an_input_gets_one_vector_alone_and_inside_a_batch(
    embedder: Callable[..., EmbeddingEngineCore],
) -> None:
    async def scenario() -> None:
        engine = embedder()
        alone = [vector((await engine.embed([text])).vectors[0]) for text in TEXTS]
        assert engine.scheduler.batches == len(TEXTS)
        before = engine.scheduler.batches
        # Every request queued before the engine thread steps: they share forward passes.
        jobs = [engine.embed([text, *TEXTS]) for text in TEXTS]
        results = await asyncio.gather(*jobs)
        passes = engine.scheduler.batches - before
        assert passes < len(TEXTS), f"{passes} forward passes for {len(TEXTS)} requests"
        for text_index, result in enumerate(results):
            got = [vector(v) for v in result.vectors]
            assert len(got) == 1 + len(TEXTS)
            np.testing.assert_allclose(got[0], alone[text_index], atol=2e-6)
            for inside, expected in zip(got[1:], alone, strict=True):
                np.testing.assert_allclose(inside, expected, atol=2e-6)
        # Different inputs give different vectors (the comparison above could not pass by chance).
        assert min(np.abs(a - b).max() for a in alone for b in alone if a is not b) > 1e-3

    run(scenario())


def test_vectors_are_unit_length_and_cut_only_to_documented_lengths(
    embedder: Callable[..., EmbeddingEngineCore],
) -> None:
    async def scenario() -> None:
        engine = embedder()
        full = vector((await engine.embed(TEXTS[:1])).vectors[0])
        assert full.shape == (128,)
        assert np.linalg.norm(full) == pytest.approx(1.0, abs=1e-5)
        for dimensions in (32, 64, 100):
            cut = vector((await engine.embed(TEXTS[:1], dimensions=dimensions)).vectors[0])
            assert cut.shape == (dimensions,)
            np.testing.assert_allclose(
                cut, full[:dimensions] / np.linalg.norm(full[:dimensions]), atol=1e-6
            )
        same = vector((await engine.embed(TEXTS[:1], dimensions=128)).vectors[0])
        np.testing.assert_array_equal(same, full)
        with pytest.raises(ValueError, match="dimensions must be from 32 to 128"):
            await engine.add_embedding_request(TEXTS[:1], dimensions=16)

    run(scenario())


def test_a_model_without_matryoshka_lengths_refuses_dimensions(
    embedder: Callable[..., EmbeddingEngineCore], minilm_model: EmbeddingModel
) -> None:
    async def scenario() -> None:
        engine = embedder(minilm_model)
        with pytest.raises(ValueError, match=r"documents no shorter \(Matryoshka\) ones"):
            await engine.add_embedding_request(["hello"], dimensions=128)
        text = vector((await engine.embed(["I like grapes"])).vectors[0])
        assert text.shape == (384,)
        # A text and its own token ids (the model's special tokens put around both) agree.
        ids = minilm_model.tokenizer.encode("I like grapes", add_special_tokens=False)
        np.testing.assert_allclose(vector((await engine.embed([ids])).vectors[0]), text, atol=1e-6)
        similar, other = (await engine.embed(["I like fruits", "It rains all day"])).vectors
        assert float(text @ vector(similar)) > float(text @ vector(other)) + 0.3

    run(scenario())


@pytest.mark.parametrize(
    ("inputs", "limits", "refusal"),
    [
        ([[5] * 300], {}, r"input\[0\] is 302 tokens, over the model's limit of 256"),
        ([[5, 6], [4096]], {}, r"input\[1\] holds token id 4096, outside the model's vocabulary"),
        (["a", ""], {}, r"input\[1\] is an empty string"),
        (["a"] * 5, {"max_inputs": 4}, "5 inputs are over the limit of 4"),
        (["one two three"] * 3, {"max_request_tokens": 12}, "over the limit of 12 tokens"),
    ],
)
def test_inputs_over_a_limit_are_refused_before_the_batch(
    embedder: Callable[..., EmbeddingEngineCore],
    inputs: list[Any],
    limits: dict[str, int],
    refusal: str,
) -> None:
    async def scenario() -> None:
        engine = embedder(**limits)
        with pytest.raises(ValueError, match=refusal):
            await engine.add_embedding_request(inputs)
        assert engine.stats().scheduler.num_requests_processed == 0

    run(scenario())


def test_a_burst_of_requests_shares_one_pass_and_a_bad_one_fails_alone(
    embedder: Callable[..., EmbeddingEngineCore],
) -> None:
    async def scenario() -> None:
        engine = embedder()
        alone = vector((await engine.embed([TEXTS[0]])).vectors[0])
        before = engine.scheduler.batches
        # Asked in one turn of the loop: made together (one tokenizer call) and stepped together;
        # a text the tokenizer refuses (a lone surrogate), an empty one and a token id outside
        # the vocabulary fail their own requests only.
        asked: list[list[str | list[int]]] = [[TEXTS[0]], ["\ud800 lone"], [TEXTS[1], ""]]
        asked.append([[5, 4096]])
        for text in TEXTS:
            asked.append([text])
        results = await asyncio.gather(
            *(engine.embed(inputs) for inputs in asked), return_exceptions=True
        )
        assert isinstance(results[1], TypeError)
        assert isinstance(results[2], ValueError) and "input[1] is an empty string" in str(
            results[2]
        )
        assert isinstance(results[3], ValueError) and "token id 4096" in str(results[3])
        good = [r for r in results if not isinstance(r, BaseException)]
        assert len(good) == 1 + len(TEXTS)
        assert engine.scheduler.batches - before == 1
        np.testing.assert_allclose(vector(good[0].vectors[0]), alone, atol=2e-6)
        np.testing.assert_allclose(vector(good[1].vectors[0]), alone, atol=2e-6)
        assert engine.stats().scheduler.num_requests_processed == 1 + 1 + len(TEXTS)

    run(scenario())


def test_steps_hold_to_the_token_budget_and_an_abort_ends_a_long_request(
    embedder: Callable[..., EmbeddingEngineCore],
) -> None:
    async def scenario() -> None:
        engine = embedder(max_batch_tokens=64)
        inputs = [[5, 6, 7, 8]] * 40  # 6 tokens each with [CLS] and [SEP]: 10 a pass
        request_id = await engine.add_embedding_request(inputs)
        outputs = []
        async for output in engine.stream_outputs(request_id):
            outputs.append(output)
            if len(outputs) == 2:
                assert await engine.abort_request(request_id)
        assert [len(o.embeddings or []) for o in outputs[:2]] == [10, 10]
        assert [o.embedding_index for o in outputs[:2]] == [0, 10]
        assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
        assert engine.stats().scheduler.num_requests_processed == 1

    run(scenario())


def test_each_engine_refuses_the_other_kind_of_request(
    embedder: Callable[..., EmbeddingEngineCore], engine: EngineCore
) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match="makes no embeddings"):
            await engine.add_embedding_request(["hello"])
        with pytest.raises(ValueError, match="is an embedding model"):
            await embedder().add_request("hello")

    run(scenario())
