"""Speculative decoding with a draft model: the same outputs as without it.

The draft for the tiny fixture is a real smaller model of its tokenizer: its first two layers
(``models/draft.py``, as ``smollm2-draft`` is for SmolLM2), so drafts are partly right and the
rollback of the draft's cache after a rejection is exercised. The tiny model drafting for
itself must have every greedy draft accepted: any drift of a draft cache from its sequence
would show as a rejection.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.utils import load_tokenizer

from mlx_redis_worker.engine import EngineCore, SamplingParams, SpeculativeParams
from mlx_redis_worker.engine.config import DraftModel
from mlx_redis_worker.engine.sampling import CategoricalSampler
from mlx_redis_worker.engine.speculative_batch import (
    ModelDrafter,
    _rejection_arrays,
    _sampled_verdict,
)
from mlx_redis_worker.models import load_model
from mlx_redis_worker.models.draft import prepare_truncated
from tests.support.engines import PROMPTS, REPEATING, MakeEngine
from tests.support.speculation import CELLS, chi_square, emitted_pair, two_position_target
from tests.support.waiting import run


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> DraftModel:
    folder = prepare_truncated(tiny_model_path, 2, tmp_path_factory.mktemp("draft") / "first2")
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 2
    model, tokenizer = load_model(str(folder))
    assert len(model.model.layers) == 2
    return DraftModel("tiny-first2", model, tokenizer)


def _params(max_tokens: int, method: str | None, k: int = 4, **sampling: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling.pop("temperature", 0.0),
        speculative=SpeculativeParams(method=method, num_draft_tokens=k)  # type: ignore[arg-type]
        if method
        else None,
        **sampling,
    )


async def _staggered(
    engine: EngineCore,
    first: list[tuple[str, SamplingParams]],
    later: list[tuple[str, SamplingParams]],
    abort: int | None = None,
    speculating_left: list[int] | None = None,
) -> list[list[int]]:
    """Tokens of each request; ``later`` join once the first request has 6 tokens (or has
    ended), and the request at index ``abort`` (of first + later) is aborted after its own
    3rd token."""
    outputs: list[list[int]] = []
    joined = asyncio.Event()

    async def one(index: int, request_id: str) -> list[int]:
        tokens: list[int] = outputs[index]
        async for output in engine.stream_outputs(request_id):
            tokens += output.new_token_ids
            if index == 0 and len(tokens) >= 6:
                joined.set()
            if index == abort and len(tokens) >= 3:
                await engine.abort_request(request_id)
        joined.set()
        return tokens

    tasks = []
    for prompt, params in first:
        outputs.append([])
        request_id = await engine.add_request(prompt, params)
        tasks.append(asyncio.create_task(one(len(outputs) - 1, request_id)))
    await joined.wait()
    for prompt, params in later:
        outputs.append([])
        request_id = await engine.add_request(prompt, params)
        tasks.append(asyncio.create_task(one(len(outputs) - 1, request_id)))
    await asyncio.gather(*tasks)
    generator = engine.scheduler._generator
    if speculating_left is not None and generator is not None:
        speculating_left.append(len(generator.speculating))
    await engine.stop()
    return outputs


def test_greedy_draft_model_rows_equal_the_plain_engine_in_a_mixed_batch(
    tiny_model: Any, tiny_draft: DraftModel, make_engine: MakeEngine
) -> None:
    # Draft-model rows, prompt-lookup rows and a plain row; rows of different lengths leave
    # mid-run and three more join once the first has 6 tokens.
    first = [
        (REPEATING[0], 40, "draft_model", 4),
        (REPEATING[1], 12, "draft_model", 2),
        (PROMPTS[1], 30, "prompt_lookup", 4),
        (PROMPTS[2], 25, None, 0),
        (REPEATING[2], 40, "draft_model", 6),
    ]
    later = [
        (REPEATING[3], 30, "draft_model", 3),
        (PROMPTS[5], 20, "prompt_lookup", 2),
        (PROMPTS[6], 36, "draft_model", 5),
    ]

    def requests(rows: list[Any], speculate: bool) -> list[tuple[str, SamplingParams]]:
        return [(p, _params(n, m if speculate else None, k)) for p, n, m, k in rows]

    plain = run(_staggered(make_engine(tiny_model), requests(first, False), requests(later, False)))
    engine = make_engine(tiny_model, draft=tiny_draft)
    speculative = run(_staggered(engine, requests(first, True), requests(later, True)))
    assert speculative == plain
    counters = engine.scheduler.speculation
    # The truncated draft is partly right: accepted and rejected drafts both happened.
    assert 0 < counters.accepted < counters.drafted
    assert counters.rows > counters.steps  # rows of one step accepted differently


def test_a_model_drafting_for_itself_has_every_draft_accepted_across_abort_and_finish(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """Every draft cache stays in step with its sequence: one request is aborted mid-run,
    others finish at different lengths, three join later, and still no draft is rejected."""
    itself = DraftModel("tiny", *tiny_model)
    lengths = zip(REPEATING, (30, 9, 24, 30), strict=True)
    first = [(p, _params(n, "draft_model", 3)) for p, n in lengths]
    later = [(p, _params(20, "draft_model", 4)) for p in PROMPTS[:3]]
    plain_rows = [(p, _params(n, None)) for p, n in zip(REPEATING, (30, 9, 24, 30), strict=True)]
    plain = run(
        _staggered(
            make_engine(tiny_model), plain_rows, [(p, _params(20, None)) for p in PROMPTS[:3]]
        )
    )
    engine = make_engine(tiny_model, draft=itself)
    left: list[int] = []
    outputs = run(_staggered(engine, first, later, abort=2, speculating_left=left))
    assert outputs[2] == plain[2][: len(outputs[2])] and len(outputs[2]) < len(plain[2])
    assert outputs[:2] + outputs[3:] == plain[:2] + plain[3:]
    counters = engine.scheduler.speculation
    assert counters.drafted > 50 and counters.accepted == counters.drafted
    assert left == [0]  # every drafter was let go with its sequence


def test_the_draft_cache_rolls_back_to_what_the_target_accepted(tiny_draft: DraftModel) -> None:
    """After any verdict the next drafts (and their q) are those of a fresh draft cache fed
    the same context: the rejected drafts left the cache, the accepted ones stayed."""
    tokenizer = tiny_draft.tokenizer
    context = tokenizer.encode(REPEATING[0])
    sampler_seed = 7

    def drafts(drafter: ModelDrafter, ctx: list[int], pending: int, sampled: bool) -> Any:
        sampler = (
            CategoricalSampler(SamplingParams(temperature=1.0, seed=sampler_seed))
            if sampled
            else None
        )
        tokens, dist = drafter.draft(ctx, pending, 4, sampler)
        mx.eval(tokens, dist if dist is not None else tokens)
        listed: list[int] = tokens.tolist()
        drafter.drafted(listed)
        return listed, dist

    for sampled in (False, True):
        drafter = ModelDrafter(tiny_draft.model)
        ctx, pending = context[:-1], context[-1]
        first, _ = drafts(drafter, ctx, pending, sampled)
        assert len(drafter) == len(ctx) + 1 + 3  # the last draft is never fed to the draft
        # Accept a = 0 .. 4 drafts, then the target's next token: one that is not the draft.
        for accepted in range(5):
            step = ModelDrafter(tiny_draft.model)
            drafts(step, ctx, pending, sampled)
            grown = [*ctx, pending, *first[:accepted]]
            following = (first[accepted] + 1) % 4096 if accepted < 4 else 17
            got, got_q = drafts(step, grown, following, sampled)
            fresh, fresh_q = drafts(ModelDrafter(tiny_draft.model), grown, following, sampled)
            assert got == fresh, (sampled, accepted)
            if sampled:
                assert mx.allclose(got_q, fresh_q, atol=1e-5).item()
            assert len(step) == len(grown) + 1 + 3
        # The target emitted exactly the fed draft as its next token: the cache held it all.
        step = ModelDrafter(tiny_draft.model)
        drafts(step, ctx, pending, sampled)
        got, _ = drafts(step, [*ctx, pending, *first[:2]], first[2], sampled)
        grown = [*ctx, pending, *first[:2]]
        fresh, _ = drafts(ModelDrafter(tiny_draft.model), grown, first[2], sampled)
        assert got == fresh


def test_rejection_rule_with_draft_distributions_keeps_the_target_distribution() -> None:
    """Drafts drawn from q (a draft model's distributions) at two positions of a 6-token
    vocabulary: accept with min(1, p/q), redraw from norm(max(0, p - q)); the emitted pair
    follows p0 x p1 (chi-square, fixed seeds)."""
    logprobs, table, expected = two_position_target()
    q_logits = mx.array([[0.0, 2.0, 0.5, 1.0, 0.5, -2.0], [1.0, 0.0, 1.5, -1.0, 0.5, 0.0]])
    q = mx.softmax(q_logits, axis=-1)
    n = 6000
    draws = mx.random.categorical(
        mx.broadcast_to(q_logits, (n, 2, CELLS)), key=mx.random.key(99)
    ).tolist()
    sampler = CategoricalSampler(SamplingParams(temperature=1.0, top_p=1.0, seed=4321))
    seen: Counter[tuple[int, int]] = Counter()
    rejected = 0
    for draft in draws:
        arrays = _rejection_arrays(sampler, table, draft, q)
        verdict = _sampled_verdict(draft, arrays, table)
        rejected += verdict.accepted < 2
        seen[emitted_pair(draft, verdict, sampler, logprobs)] += 1
    assert 0.2 * n < rejected < 0.9 * n  # q is far from p: both branches ran often
    # 35 degrees of freedom: 66.6 is the 0.999 quantile.
    assert chi_square(seen, expected, n) < 66.6, seen


def test_sampled_draft_model_rows_keep_the_distribution_of_the_plain_engine(
    tiny_model: Any, tiny_draft: DraftModel, make_engine: MakeEngine
) -> None:
    """200 seeded requests with the truncated draft and 200 without (top_k=2, 4 tokens: 16
    outcomes) give one distribution (two-sample chi-square)."""
    prompt = "one two three"

    def outcomes(method: str | None, seeds: range) -> tuple[Counter[tuple[int, ...]], Any]:
        engine = make_engine(tiny_model, speculative_max_batch=32, draft=tiny_draft)
        params = [_params(4, method, 3, temperature=1.0, top_p=1.0, top_k=2, seed=s) for s in seeds]
        found = run(_staggered(engine, [(prompt, p) for p in params], []))
        return Counter(tuple(t) for t in found), engine.scheduler.speculation

    plain, _ = outcomes(None, range(200))
    speculative, counters = outcomes("draft_model", range(1000, 1200))
    assert counters.drafted > 100 and 0 < counters.accepted < counters.drafted
    cells = set(plain) | set(speculative)
    assert len(cells) <= 16
    statistic = sum((plain[c] - speculative[c]) ** 2 / (plain[c] + speculative[c]) for c in cells)
    assert statistic < 37.7, (statistic, plain, speculative)


def test_a_draft_of_another_tokenizer_is_refused_and_so_is_draft_model_without_one(
    tiny_model: Any, smollm2_model_path: Path, make_engine: MakeEngine
) -> None:
    model, _ = tiny_model
    other = DraftModel("tiny-with-smollm2-tokenizer", model, load_tokenizer(smollm2_model_path))
    with pytest.raises(ValueError, match="another tokenizer"):
        make_engine(tiny_model, draft=other)

    engine = make_engine(tiny_model)

    async def ask() -> None:
        await engine.add_request("hello", _params(8, "draft_model"))

    with pytest.raises(ValueError, match="no draft model"):
        run(ask())


@pytest.mark.smollm2
def test_greedy_draft_model_equals_the_plain_engine_on_smollm2(
    smollm2_model: Any, make_engine: MakeEngine
) -> None:
    """SmolLM2 with smollm2-draft (its first 24 layers): some drafts accepted, many rejected,
    the output token for token the plain engine's."""
    from mlx_redis_worker.models.draft import prepare_smollm2_draft

    draft = DraftModel("smollm2-draft", *load_model(str(prepare_smollm2_draft())))
    _, tokenizer = smollm2_model
    asks = [
        "Quote this sentence exactly: the lighthouse stood on the northern cliff for two "
        "hundred years, and every night its keeper climbed the stairs.",
        'Fill in this JSON for Ada Lovelace: {"name": "", "born": 0, "field": ""}',
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        for ask in asks
    ]
    # Greedy, so the same drafts and verdicts every run: these lengths see both accepted and
    # rejected drafts (the assertions below), at a third of the cost of 40 tokens each.
    tokens = 16
    plain = run(
        _staggered(make_engine(smollm2_model), [(p, _params(tokens, None)) for p in prompts], [])
    )
    engine = make_engine(smollm2_model, draft=draft)
    drafted = run(_staggered(engine, [(p, _params(tokens, "draft_model", 4)) for p in prompts], []))
    assert drafted == plain
    counters = engine.scheduler.speculation
    assert 0 < counters.model_accepted < counters.model_drafted == counters.drafted
