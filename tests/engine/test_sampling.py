"""The batched draw and the candidate-first top-p against mlx-lm's own functions."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_p

from mlx_redis_worker.engine.request import SamplingParams
from mlx_redis_worker.engine.sampling import (
    TOP_P_CANDIDATES,
    TOP_P_SORT_AVOIDED_FROM,
    CategoricalSampler,
    draw_rows,
    top_p_filtered,
)

VOCAB = 49_152  # SmolLM2's: past TOP_P_SORT_AVOIDED_FROM


def log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("spread", [1.0, 4.0, 12.0])  # flat (the whole sort) to peaked
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.97])
def test_top_p_keeps_what_mlx_lms_keeps(spread: float, top_p: float) -> None:
    assert VOCAB >= TOP_P_SORT_AVOIDED_FROM and mx.default_device().type == mx.cpu
    mx.random.seed(int(spread * 100 + top_p * 10))
    logprobs = log_softmax(mx.random.normal((6, VOCAB)) * spread)
    ours, theirs = top_p_filtered(logprobs, top_p), apply_top_p(logprobs, top_p)
    assert mx.array_equal(mx.isinf(ours), mx.isinf(theirs)).item()
    assert mx.array_equal(mx.where(mx.isinf(ours), 0, ours), logprobs * ~mx.isinf(theirs)).item()
    kept = (~mx.isinf(ours)).sum(axis=-1).tolist()
    if spread == 12.0:  # peaked: the nucleus lies among the candidates
        assert max(kept) <= TOP_P_CANDIDATES


def test_draw_rows_draws_what_each_rows_sampler_draws_alone() -> None:
    mx.random.seed(5)
    settings = [
        {"temperature": 1.5},
        {"temperature": 0.4, "top_p": 1.0},
        {"temperature": 1.0, "top_k": 5},
        {"temperature": 0.8, "min_p": 0.05},
        {"temperature": 1.0, "top_p": 0.8, "top_k": 40},
    ]
    for vocab in (7, 4096, VOCAB):
        logprobs = log_softmax(mx.random.normal((len(settings), vocab)) * 6)
        params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(settings)]
        alone = [CategoricalSampler(p) for p in params]
        together = [CategoricalSampler(p) for p in params]
        for _ in range(5):
            expected = [int(s(logprobs[i : i + 1]).item()) for i, s in enumerate(alone)]
            assert draw_rows(together, logprobs).tolist() == expected, vocab
