"""Greedy generations of the tiny model on an engine in the test's own process: what a
worker's greedy output must equal."""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import functools
from collections.abc import Sequence
from typing import Any

from mlx_redis_worker.engine import EngineCore, RequestOutput, SamplingParams
from mlx_redis_worker.models import load_model


class GreedyReference:
    """Greedy texts of one model, each (prompt, max_tokens) generated once."""

    def __init__(self, model_and_tokenizer: tuple[Any, Any]) -> None:
        self.model, self.tokenizer = model_and_tokenizer
        self._known: dict[tuple[str, int], str] = {}

    def texts(self, prompts: Sequence[str], max_tokens: int) -> list[str]:
        """The greedy text of each prompt, in order (repeats allowed)."""
        missing = [p for p in dict.fromkeys(prompts) if (p, max_tokens) not in self._known]
        if missing:
            outputs = self._generate(
                missing, SamplingParams(max_tokens=max_tokens, temperature=0.0)
            )
            for prompt, output in zip(missing, outputs, strict=True):
                self._known[(prompt, max_tokens)] = output.output_text
        return [self._known[(p, max_tokens)] for p in prompts]

    def by_prompt(self, prompts: Sequence[str], max_tokens: int) -> dict[str, str]:
        """``texts`` as prompt -> greedy text."""
        return dict(zip(prompts, self.texts(prompts, max_tokens), strict=True))

    def first_token(self, prompt: str) -> int:
        """The first greedy token of ``prompt``."""
        (output,) = self._generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        return int(output.output_token_ids[0])

    def _generate(self, prompts: Sequence[str], params: SamplingParams) -> list[RequestOutput]:
        batch: list[str | list[int]] = list(prompts)
        engine = EngineCore(self.model, self.tokenizer)
        try:
            return engine.generate_batch_sync(batch, params)
        finally:
            engine.close()


@functools.cache
def model_reference(model: str) -> GreedyReference:
    """A model's reference, one per process, on a model object of its own: an engine takes
    ownership of the model it runs."""
    return GreedyReference(load_model(model))


def tiny_reference() -> GreedyReference:
    return model_reference("tiny")
