"""Per-request samplers, logits processors and stop-token sets for mlx-lm's BatchGenerator.

Every stochastic request gets its own PRNG key (from ``seed``, or fresh entropy), split once per
step, so a seeded request samples the same tokens whatever else shares its batch. Greedy
requests get ``None`` so BatchGenerator can argmax the whole batch in one call. The filters
(top-p, min-p, top-k) and penalties are mlx-lm's own.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Final

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


# A filter of mlx-lm's by name, and its setting: top_p, min_p (floats) or top_k (an int).
Filter = tuple[str, float]


# Top-p among the likeliest tokens first where the vocabulary is this large and MLX runs on
# the CPU, whose sort of a row is slow (4.6 ms a row of 49,152 tokens).
TOP_P_CANDIDATES: Final = 256
TOP_P_SORT_AVOIDED_FROM: Final = 16_384


def top_p_filtered(logprobs: mx.array, top_p: float) -> mx.array:
    """mlx-lm's ``apply_top_p``: keep the likeliest tokens whose mass reaches ``top_p`` (of
    log-probabilities, whose mass is 1). On the CPU with a large vocabulary the nucleus is
    first looked for among the ``TOP_P_CANDIDATES`` likeliest tokens, sorted alone; only where
    a row's nucleus is wider is the whole vocabulary sorted, as mlx-lm does. The same
    threshold but for the rounding of the whole mass (mlx-lm sums it; here it is 1). It waits
    for the logits on the host, which a GPU's step overlap could not afford."""
    if logprobs.shape[-1] < TOP_P_SORT_AVOIDED_FROM or mx.default_device().type != mx.cpu:
        whole: mx.array = apply_top_p(logprobs, top_p)
        return whole
    candidates = mx.sort(mx.topk(logprobs, TOP_P_CANDIDATES, axis=-1), axis=-1)
    probs = mx.exp(candidates.astype(mx.float32))
    # As mlx-lm's: the mass above each candidate and how many it drops; every token below the
    # candidates is dropped too when the candidates hold top_p of the mass.
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    held = mass_above[..., :1] + probs[..., :1]
    if not mx.all(held >= top_p).item():
        whole = apply_top_p(logprobs, top_p)
        return whole
    dropped = (mass_above >= top_p).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(candidates, dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


def _filtered(logprobs: mx.array, name: str, setting: float) -> mx.array:
    if name == "top_p":
        filtered: mx.array = top_p_filtered(logprobs, setting)
    elif name == "min_p":
        filtered = apply_min_p(logprobs, setting, 1)
    elif int(setting) < logprobs.shape[-1]:
        filtered = apply_top_k(logprobs, int(setting))
    else:  # k at or above the vocabulary keeps every token: no filter (mlx-lm refuses it)
        filtered = logprobs
    return filtered


class CategoricalSampler:
    """Samples from the request's filtered, tempered distribution with its own PRNG key.

    Speculative verification (engine/speculative_batch.py) reads the same distribution
    (``logits``) and draws from the same key (``next_key``), so a speculating request keeps
    exactly the distribution it would sample from without speculation.
    """

    __slots__ = ("_key", "filters", "inverse_temperature")

    def __init__(self, params: SamplingParams) -> None:
        # mlx-lm's filters, in the order they apply (top-p, min-p, top-k), with their settings.
        filters: list[Filter] = []
        if 0.0 < params.top_p < 1.0:
            filters.append(("top_p", params.top_p))
        if params.min_p > 0.0:
            filters.append(("min_p", params.min_p))
        if params.top_k > 0:
            filters.append(("top_k", params.top_k))
        self.filters = tuple(filters)
        self.inverse_temperature = 1.0 / params.temperature
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, step_key = mx.random.split(self._key)
        return step_key

    def logits(self, logprobs: mx.array) -> mx.array:
        """The logits whose softmax is the distribution this sampler draws from."""
        for name, setting in self.filters:
            logprobs = _filtered(logprobs, name, setting)
        return logprobs * self.inverse_temperature

    def __call__(self, logprobs: mx.array) -> mx.array:
        step_key = self.next_key()
        return mx.random.categorical(self.logits(logprobs), key=step_key)


def draw_rows(samplers: Sequence[CategoricalSampler], logprobs: mx.array) -> mx.array:
    """Row ``i`` of ``logprobs`` ([rows, vocab]) drawn by ``samplers[i]``: the token that
    ``samplers[i](logprobs[i : i + 1])`` draws (the same key, the same uniform, the same
    inverse-CDF search MLX runs for one row), for all rows in one computation. Row by row, each
    draw was a dozen small operations: on tiny, 32 rows at temperature 1 decoded at 0.72 of
    greedy's tok/s."""
    logits = logprobs
    # Each filter row-wise, so rows of one filter and setting (most share the defaults) are
    # filtered together, in each sampler's order.
    for stage in range(max(len(sampler.filters) for sampler in samplers)):
        groups: dict[Filter, list[int]] = {}
        for row, sampler in enumerate(samplers):
            if stage < len(sampler.filters):
                groups.setdefault(sampler.filters[stage], []).append(row)
        for (name, setting), rows in groups.items():
            if len(rows) == len(samplers):
                logits = _filtered(logits, name, setting)
                continue
            if logits is logprobs:
                logits = mx.array(logprobs)  # a copy: the caller's array stays as it is
            index = mx.array(rows)
            logits[index] = _filtered(logits[index], name, setting)
    scales = mx.array([sampler.inverse_temperature for sampler in samplers])
    logits = logits * scales[:, None]
    keys = mx.stack([sampler.next_key() for sampler in samplers])
    return _inverse_cdf_rows(logits, _ROW_UNIFORMS(keys)[:, 0])


# One uniform a row, each from its row's key: MLX's one-row categorical draws exactly this.
_ROW_UNIFORMS = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))


def _inverse_cdf_rows(logits: mx.array, uniforms: mx.array) -> mx.array:
    """MLX's categorical sampling of a single row (``categorical_inverse_cdf``) for each row:
    the index where ``uniform * total`` falls in the row's exclusive cumulative weights (its
    weights ``exp(x - max)``, or 1 at each maximum of a row whose maximum is infinite)."""
    x = logits.astype(mx.float32)
    top = mx.max(x, axis=-1, keepdims=True)
    weights = mx.where(mx.isinf(top), (x == top).astype(mx.float32), mx.exp(x - top))
    cdf = mx.cumsum(weights, axis=-1, inclusive=False)
    point = uniforms[:, None] * mx.sum(weights, axis=-1, keepdims=True)
    # The weights are not negative, so the cdf is sorted: searchsorted(cdf, point, "right") is
    # the count of cells at or below the point (all of them where a row is NaN, as MLX's).
    below = mx.sum(cdf <= point, axis=-1)
    return (mx.where(below == 0, x.shape[-1], below) - 1).astype(mx.uint32)


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


class GuardedSampler:
    """A sequence's sampler with its failures contained to the sequence (a greedy stand-in,
    the request failed after); ``sampler`` stays reachable so a step can draw every
    categorical row together (``draw_rows``)."""

    __slots__ = ("on_error", "sampler")

    def __init__(self, sampler: Sampler, on_error: Callable[[BaseException], None]) -> None:
        self.sampler = sampler
        self.on_error = on_error

    def __call__(self, logprobs: mx.array) -> mx.array:
        try:
            return self.sampler(logprobs)
        except Exception as exc:
            self.on_error(exc)
            return mx.argmax(logprobs, axis=-1)

    @property
    def categorical(self) -> CategoricalSampler | None:
        """The plain categorical sampler inside, if that is what it guards."""
        return self.sampler if isinstance(self.sampler, CategoricalSampler) else None


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
