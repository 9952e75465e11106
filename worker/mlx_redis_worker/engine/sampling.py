"""Per-request samplers, logits processors and stop-token sets for mlx-lm's BatchGenerator.

Every stochastic request gets its own PRNG key (from ``seed``, or fresh entropy), split once per
step, so a seeded request samples the same tokens whatever else shares its batch. Greedy
requests get ``None`` so BatchGenerator can argmax the whole batch in one call. The filters
(top-p, min-p, top-k) and penalties are mlx-lm's own.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlx_redis_worker.engine.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def build_sampler(params: SamplingParams) -> CategoricalSampler | None:
    """A sampler for one sequence, or None for greedy decoding."""
    if params.is_greedy:
        return None
    return CategoricalSampler(params)


class CategoricalSampler:
    """Samples from the request's filtered, tempered distribution with its own PRNG key.

    Speculative verification (engine/speculative_batch.py) reads the same distribution
    (``logits``) and draws from the same key (``next_key``), so a speculating request keeps
    exactly the distribution it would sample from without speculation.
    """

    __slots__ = ("_filters", "_inverse_temperature", "_key")

    def __init__(self, params: SamplingParams) -> None:
        filters: list[Callable[[mx.array], mx.array]] = []
        if 0.0 < params.top_p < 1.0:
            filters.append(lambda x: apply_top_p(x, params.top_p))
        if params.min_p > 0.0:
            filters.append(lambda x: apply_min_p(x, params.min_p, 1))
        if params.top_k > 0:
            # k at or above the vocabulary keeps every token, i.e. no filter (mlx-lm refuses it).
            filters.append(
                lambda x: apply_top_k(x, params.top_k) if params.top_k < x.shape[-1] else x
            )
        self._filters = filters
        self._inverse_temperature = 1.0 / params.temperature
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, step_key = mx.random.split(self._key)
        return step_key

    def logits(self, logprobs: mx.array) -> mx.array:
        """The logits whose softmax is the distribution this sampler draws from."""
        for apply_filter in self._filters:
            logprobs = apply_filter(logprobs)
        return logprobs * self._inverse_temperature

    def __call__(self, logprobs: mx.array) -> mx.array:
        step_key = self.next_key()
        return mx.random.categorical(self.logits(logprobs), key=step_key)


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    def penalty(value: float, neutral: float) -> float | None:
        return None if value == neutral else value

    processors: list[LogitsProcessor] = make_logits_processors(
        repetition_penalty=penalty(params.repetition_penalty, 1.0),
        repetition_context_size=params.penalty_context_size,
        presence_penalty=penalty(params.presence_penalty, 0.0),
        presence_context_size=params.penalty_context_size,
        frequency_penalty=penalty(params.frequency_penalty, 0.0),
        frequency_context_size=params.penalty_context_size,
    )
    return processors


def build_stop_sequences(eos_token_ids: Iterable[int], params: SamplingParams) -> StopSequences:
    """Single-token stops for this request only: the model's EOS plus its ``stop_token_ids``."""
    stop_ids = set(eos_token_ids) | set(params.stop_token_ids or ())
    return StopSequences([(token,) for token in sorted(stop_ids)])


def guard_sampler(sampler: Sampler, on_error: Callable[[BaseException], None]) -> Sampler:
    """Contain a sampler failure to its own sequence (greedy stand-in, request failed after)."""

    def guarded(logprobs: mx.array) -> mx.array:
        try:
            return sampler(logprobs)
        except Exception as exc:
            on_error(exc)
            return mx.argmax(logprobs, axis=-1)

    return guarded


def guard_processor(
    processor: LogitsProcessor, on_error: Callable[[BaseException], None]
) -> LogitsProcessor:
    """Contain a logits-processor failure to its own sequence."""

    def guarded(tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            return processor(tokens, logits)
        except Exception as exc:
            on_error(exc)
            return logits

    return guarded
