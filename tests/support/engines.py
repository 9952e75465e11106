"""Engines on real models for tests: building one, collecting a stream, mlx-lm's reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx_lm

from mlx_redis_worker.engine import (
    EngineConfig,
    EngineCore,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
)

# Short prompts of different lengths, so that a batch of them needs padding.
PROMPTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "once upon a time there was",
    "a",
    "in the beginning the model",
    "numbers one two three four five six seven eight nine ten eleven twelve",
    "why is the sky blue",
    "red green",
    "the cat sat on the mat and then the cat sat on the mat again and again",
    "to be or not to be",
    "x y z",
    "tokens tokens tokens",
    "it was the best of times it was the worst of times",
    "blue",
    "what is the capital of france",
    "many words make a longer prompt so that the batch has padding to handle well",
]

# Prompts whose continuations repeat their own text: speculative drafts get accepted.
REPEATING = [
    "the cat sat on the mat and then the cat sat on the mat again and again",
    "one two three four one two three four one two three",
    "to be or not to be to be or not to be",
    "it was the best of times it was the worst of times",
]


def make_engine(model_and_tokenizer: tuple[Any, Any], **scheduler: Any) -> EngineCore:
    """An engine over ``(model, tokenizer)``; ``stream_interval`` (default 1) and ``draft``
    (a ``DraftModel``, default none) go to the engine, every other keyword to its
    ``SchedulerConfig``. The caller closes it."""
    model, tokenizer = model_and_tokenizer
    config = EngineConfig(
        stream_interval=scheduler.pop("stream_interval", 1),
        draft=scheduler.pop("draft", None),
        scheduler_config=SchedulerConfig(**scheduler),
    )
    return EngineCore(model, tokenizer, config)


def reference_tokens(
    model_and_tokenizer: tuple[Any, Any], prompt: str | list[int], max_tokens: int
) -> list[int]:
    """Greedy tokens from mlx-lm's own single-sequence generator (EOS excluded)."""
    model, tokenizer = model_and_tokenizer
    tokens = []
    for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        if response.token in tokenizer.eos_token_ids:
            break
        tokens.append(response.token)
    return tokens


def detokenized(tokenizer: Any, tokens: list[int]) -> str:
    """The text of ``tokens`` as a fresh streaming detokenizer makes it, to the end."""
    detokenizer = tokenizer.detokenizer
    for token in tokens:
        detokenizer.add_token(token)
    detokenizer.finalize()
    text: str = detokenizer.text
    return text


async def collect(engine: EngineCore, request_id: str, **kwargs: Any) -> list[RequestOutput]:
    """Every output of one request's stream, up to and with its final one."""
    return [output async for output in engine.stream_outputs(request_id, **kwargs)]


async def stream_one(
    engine: EngineCore, prompt: str, params: SamplingParams
) -> list[RequestOutput]:
    """Add one request, collect its whole stream, then stop the engine."""
    request_id = await engine.add_request(prompt, params)
    outputs = await collect(engine, request_id)
    await engine.stop()
    return outputs


# Annotations for the fixtures of the same names in tests/engine/conftest.py.
MakeEngine = Callable[..., EngineCore]
ClosedAtTeardown = Callable[[EngineCore], EngineCore]
