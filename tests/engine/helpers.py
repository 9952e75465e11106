"""Shared helpers for engine tests: run a coroutine, build engines, reference generations."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import mlx_lm

from worker.engine import EngineConfig, EngineCore, RequestOutput, SamplingParams, SchedulerConfig

T = TypeVar("T")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def make_engine(model_and_tokenizer: tuple[Any, Any], **scheduler: Any) -> EngineCore:
    model, tokenizer = model_and_tokenizer
    config = EngineConfig(
        stream_interval=scheduler.pop("stream_interval", 1),
        scheduler_config=SchedulerConfig(**scheduler),
    )
    return EngineCore(model, tokenizer, config)


def reference_tokens(
    model_and_tokenizer: tuple[Any, Any], prompt: str, max_tokens: int
) -> list[int]:
    """Greedy tokens from mlx-lm's own single-sequence generator (EOS excluded)."""
    model, tokenizer = model_and_tokenizer
    tokens = []
    for response in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        if response.token in tokenizer.eos_token_ids:
            break
        tokens.append(response.token)
    return tokens


async def collect(engine: EngineCore, request_id: str, **kwargs: Any) -> list[RequestOutput]:
    return [output async for output in engine.stream_outputs(request_id, **kwargs)]


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
