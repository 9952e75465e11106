"""Speculative decoding inside the batch: the same outputs as without it.

Greedy: token for token against the plain engine, on the tiny fixture and on SmolLM2, alone and
in mixed batches. Sampled: the rejection rule keeps the target distribution (chi-square on a
small vocabulary, fixed seeds, so the verdict never changes between runs).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from mlx_redis_worker.engine import EngineCore, SamplingParams, SpeculativeParams
from mlx_redis_worker.engine.prompt_lookup import PromptLookup
from mlx_redis_worker.engine.sampling import CategoricalSampler
from mlx_redis_worker.engine.speculative_batch import (
    FIRST_PAUSE,
    MIN_ACCEPTANCE,
    SpeculativeSequence,
    _rejection_arrays,
    _sampled_verdict,
)
from tests.support.engines import PROMPTS, REPEATING, MakeEngine
from tests.support.speculation import chi_square, emitted_pair, two_position_target
from tests.support.waiting import run


def _greedy(max_tokens: int, draft: int | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        speculative=SpeculativeParams(num_draft_tokens=draft) if draft else None,
    )


async def _tokens(engine: EngineCore, requests: list[tuple[str, SamplingParams]]) -> list[Any]:
    ids = [await engine.add_request(prompt, params) for prompt, params in requests]

    async def one(request_id: str) -> list[int]:
        tokens: list[int] = []
        async for output in engine.stream_outputs(request_id):
            tokens += output.new_token_ids
        return tokens

    outputs = await asyncio.gather(*(one(r) for r in ids))
    await engine.stop()
    return outputs


def test_prompt_lookup_drafts_what_followed_the_longest_earlier_match() -> None:
    lookup = PromptLookup(max_ngram=3)
    lookup.sync([5, 6, 7, 8, 9, 1, 6, 7])
    # ... 6 7 | 8: the 3-gram (6, 7, 8) occurred at 1..3, followed by 9 1 6.
    assert lookup.draft(8, 3) == [9, 1, 6]
    # Runs into the present: on through the fed token, then through its own guesses.
    assert lookup.draft(8, 10) == [9, 1, 6, 7, 8, 9, 1, 6, 7, 8]
    assert lookup.draft(4, 3) == []  # 4 never occurred
    assert lookup.draft(8, 0) == []
    lookup.append(8)
    assert lookup.draft(9, 2) == [1, 6]


def test_greedy_speculation_equals_the_plain_engine_on_the_tiny_model(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    prompts = REPEATING + PROMPTS[:6]
    plain = run(_tokens(make_engine(tiny_model), [(p, _greedy(40, None)) for p in prompts]))
    # Mixed: draft lengths differ per request, one request does not speculate, one has a
    # repetition penalty (a logits processor: it never drafts) and rows accept differently.
    drafts = [4, 2, 6, None, 3, 1, 5, 4, 2, 4]
    requests = [(p, _greedy(40, d)) for p, d in zip(prompts, drafts, strict=True)]
    engine = make_engine(tiny_model, speculative_max_batch=16)
    speculative = run(_tokens(engine, requests))
    assert speculative == plain
    counters = engine.scheduler.speculation
    assert counters.accepted > 0 and counters.steps > 0
    # Rows in one verify step accepted different numbers of drafts at least once: the shifted
    # cache was exercised, not only the uniform trim.
    assert counters.rows > counters.steps

    alone = [run(_tokens(make_engine(tiny_model), [(p, _greedy(40, 4))]))[0] for p in REPEATING[:2]]
    assert alone == plain[:2]


def test_speculation_stops_where_the_plain_engine_stops(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """max_tokens and a stop token inside a run of accepted drafts end the output there."""
    prompt = REPEATING[0]
    plain = run(_tokens(make_engine(tiny_model), [(prompt, _greedy(30, None))]))[0]
    stop_token = plain[7]
    for params in (
        _greedy(9, 6),
        SamplingParams(
            max_tokens=30,
            temperature=0.0,
            stop_token_ids=[stop_token],
            speculative=SpeculativeParams(num_draft_tokens=6),
        ),
    ):
        engine = make_engine(tiny_model)
        (output,) = run(_tokens(engine, [(prompt, params)]))
        cut = 9 if params.stop_token_ids is None else plain.index(stop_token)
        assert output == plain[:cut]
        # The prefix cache got the finished sequence's state, cut where its output ends.
        stats = engine.cache_stats()
        assert stats is not None and stats.stores >= 1


def test_a_batch_over_the_limit_drafts_nothing_and_stats_say_so(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    prompts = REPEATING[:3]
    plain = run(_tokens(make_engine(tiny_model), [(p, _greedy(24, None)) for p in prompts]))
    engine = make_engine(tiny_model, speculative_max_batch=2)
    assert run(_tokens(engine, [(p, _greedy(24, 4)) for p in prompts])) == plain
    stats = engine.stats().scheduler.speculation
    # Three sequences decode together: over the limit, every step is a plain one.
    assert stats.batch_backoffs > 0 and stats.steps == 0 and stats.draft_tokens == 0
    assert engine.get_stats()["speculation"]["batch_backoffs"] == stats.batch_backoffs

    engine = make_engine(tiny_model)
    assert run(_tokens(engine, [(p, _greedy(24, 4)) for p in prompts])) == plain
    stats = engine.stats().scheduler.speculation
    assert stats.steps > 0 and stats.batch_backoffs == 0
    assert stats.acceptance_rate == stats.accepted_tokens / stats.draft_tokens
    assert stats.tokens_per_step == (stats.rows + stats.accepted_tokens) / stats.rows > 1


def test_a_sequence_whose_drafts_fail_pauses_longer_each_time() -> None:
    entry = SpeculativeSequence(4, None, lambda _: None)
    assert not entry.observe(4, 4, step=1)  # all accepted
    step, pauses = 1, []
    for _ in range(4):
        while not entry.observe(0, 4, step):  # nothing accepted, until it backs off
            step += 1
        pauses.append(entry.paused_until - step)
        step = entry.paused_until
    assert pauses == [FIRST_PAUSE, 2 * FIRST_PAUSE, 4 * FIRST_PAUSE, 8 * FIRST_PAUSE]
    # Back from a pause at the threshold: one bad step backs off again, good ones recover it.
    assert entry.acceptance == MIN_ACCEPTANCE
    for _ in range(4):
        assert not entry.observe(4, 4, step)
    assert entry.pause == FIRST_PAUSE


@pytest.mark.smollm2
def test_greedy_speculation_equals_the_plain_engine_on_smollm2(
    smollm2_model: Any, make_engine: MakeEngine
) -> None:
    _, tokenizer = smollm2_model
    code = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
    asks = [
        f"Rewrite this code with the function renamed to size:\n{code}",
        'Fill in this JSON for Ada Lovelace: {"name": "", "born": 0, "field": ""}',
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        for ask in asks
    ]
    plain = run(_tokens(make_engine(smollm2_model), [(p, _greedy(48, None)) for p in prompts]))
    engine = make_engine(smollm2_model)
    batched = run(_tokens(engine, [(p, _greedy(48, 4)) for p in prompts]))
    assert batched == plain
    assert engine.scheduler.speculation.accepted > 0
    alone = run(_tokens(make_engine(smollm2_model), [(prompts[0], _greedy(48, 4))]))
    assert alone == plain[:1]


# -- sampled: the rejection rule ---------------------------------------------------------------


def test_rejection_rule_keeps_the_target_distribution() -> None:
    """Two positions, a draft at each, over a 6-token vocabulary: the tokens the rule emits
    (accepted drafts, then the redraw) follow p0 x p1 whatever the drafts are."""
    logprobs, table, expected = two_position_target()
    n = 6000
    for draft in ([0, 1], [4, 2]):  # a likely draft, and an unlikely one
        sampler = CategoricalSampler(SamplingParams(temperature=1.0, top_p=1.0, seed=1234))
        seen: Counter[tuple[int, int]] = Counter()
        for _ in range(n):
            arrays = _rejection_arrays(sampler, table, draft)
            verdict = _sampled_verdict(draft, arrays, table)
            seen[emitted_pair(draft, verdict, sampler, logprobs)] += 1
        # 35 degrees of freedom: 66.6 is the 0.999 quantile.
        assert chi_square(seen, expected, n) < 66.6, (draft, seen)


def test_sampled_speculation_keeps_the_distribution_of_the_plain_engine(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """The tiny model through the whole engine with top_k=2, so four tokens have 16 outcomes:
    200 seeded requests with speculation and 200 without give one distribution (two-sample
    chi-square). The tiny model often repeats a token, and a repeat is drafted from the
    output itself (a a -> a), so many outputs went through a verify step."""
    prompt = "one two three"

    def params(seed: int, spec: bool) -> SamplingParams:
        return SamplingParams(
            max_tokens=4,
            temperature=1.0,
            top_p=1.0,
            top_k=2,
            seed=seed,
            speculative=SpeculativeParams(num_draft_tokens=2) if spec else None,
        )

    def outcomes(spec: bool, seeds: range) -> tuple[Counter[tuple[int, ...]], Any]:
        # 32 sequences decode together: drafting must stay on for the whole batch.
        engine = make_engine(tiny_model, speculative_max_batch=32)
        found = run(_tokens(engine, [(prompt, params(s, spec)) for s in seeds]))
        return Counter(tuple(t) for t in found), engine.scheduler.speculation

    plain, _ = outcomes(False, range(200))
    speculative, counters = outcomes(True, range(1000, 1200))
    assert counters.drafted > 20 and 0 < counters.accepted < counters.drafted
    cells = set(plain) | set(speculative)
    assert len(cells) <= 16
    statistic = sum((plain[c] - speculative[c]) ** 2 / (plain[c] + speculative[c]) for c in cells)
    # 0.999 quantile of chi-square with 15 degrees of freedom (fewer cells: a lower quantile).
    assert statistic < 37.7, (statistic, plain, speculative)
