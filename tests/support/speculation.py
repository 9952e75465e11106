"""What the tests of the rejection rule share: a two-position target over a small vocabulary,
the two tokens a verdict emits there, and the chi-square statistic that compares them with the
target's distribution."""

from __future__ import annotations

from collections import Counter
from typing import Any, cast

import mlx.core as mx

from mlx_redis_worker.engine.sampling import CategoricalSampler
from mlx_redis_worker.engine.speculative_batch import _Verdict

# The vocabulary of the target below: 6 tokens, so 36 cells for a pair of them.
CELLS = 6


def two_position_target() -> tuple[mx.array, mx.array, dict[tuple[int, int], float]]:
    """The target's log-probabilities at two positions, the table a verify step reads (a
    third position, after both drafts, repeats the second), and the probability of each pair
    of tokens: p0 x p1."""
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 1.0, 0.0, 0.7]])
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    table = mx.concatenate([logprobs, logprobs[1:]])
    p0, p1 = (cast(list[float], mx.exp(logprobs[i]).tolist()) for i in (0, 1))
    expected = {(a, b): p0[a] * p1[b] for a in range(CELLS) for b in range(CELLS)}
    return logprobs, table, expected


def emitted_pair(
    draft: list[int], verdict: _Verdict, sampler: CategoricalSampler, logprobs: mx.array
) -> tuple[int, int]:
    """The first two tokens a sequence emits from a two-token ``draft`` and its verdict: the
    accepted drafts, then the verdict's token. With no draft accepted the second token comes
    from the next step: drawn from ``logprobs[1]`` with the sampler's next key, as that step
    would."""
    first = draft[0] if verdict.accepted >= 1 else verdict.next_token
    if verdict.accepted == 0:
        drawn = mx.random.categorical(logprobs[1], key=sampler.next_key())
        second = cast(int, drawn.item())
    elif verdict.accepted == 1:
        second = verdict.next_token
    else:
        second = draft[1]
    return first, second


def chi_square(observed: Counter[Any], expected: dict[Any, float], n: int) -> float:
    """Pearson's statistic of ``n`` observations against the cell probabilities ``expected``."""
    return sum((observed[c] - n * p) ** 2 / (n * p) for c, p in expected.items())
