"""The real SmolLM2-135M-Instruct through the engine: a batch of chats answers correctly."""

from __future__ import annotations

from typing import Any

import mlx_lm
import pytest

from mlx_redis_worker.engine import SamplingParams
from tests.support.engines import MakeEngine
from tests.support.waiting import run

pytestmark = pytest.mark.smollm2

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 plus 2?",
    "Say hello in Spanish.",
]


def _chat(tokenizer: Any, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    prompt: str = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return prompt


def test_batched_chat_matches_mlx_lm_and_knows_paris(
    smollm2_model: Any, make_engine: MakeEngine
) -> None:
    model, tokenizer = smollm2_model
    prompts = [_chat(tokenizer, q) for q in QUESTIONS]
    engine = make_engine(smollm2_model)

    async def scenario() -> list[Any]:
        finals = [
            await engine.generate(p, SamplingParams(max_tokens=24, temperature=0.0))
            for p in prompts[:1]
        ]
        ids = [
            await engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0))
            for p in prompts
        ]
        for rid in ids:
            final = None
            async for output in engine.stream_outputs(rid):
                final = output
            finals.append(final)
        await engine.stop()
        return finals

    alone, *batched = run(scenario())
    assert "Paris" in alone.output_text
    assert alone.finish_reason == "stop"  # ended by <|im_end|>, which is not in the text
    assert "<|im_end|>" not in alone.output_text
    for prompt, output in zip(prompts, batched, strict=True):
        expected = mlx_lm.generate(model, tokenizer, prompt, max_tokens=24)
        assert output.output_text == expected
    assert batched[0].output_text == alone.output_text
    assert batched[0].cached_tokens > 0  # the identical first prompt reused the prefix cache
