"""Generation through the real engine on a real (tiny, random-weight) MLX model."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from mlx_redis_worker.engine import EngineCore, SamplingParams
from tests.support.engines import (
    PROMPTS,
    MakeEngine,
    collect,
    detokenized,
    reference_tokens,
    stream_one,
)
from tests.support.waiting import run

MAX_TOKENS = 12


def test_greedy_batch_equals_mlx_lm_generate_token_for_token(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model, max_num_seqs=16, prefill_batch_size=16)
    outputs = engine.generate_batch_sync(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )
    assert len(outputs) == 16
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert output.finished
        assert output.output_token_ids == reference_tokens(tiny_model, prompt, MAX_TOKENS), prompt
        assert output.new_text == output.output_text  # the whole text, as from generate()


def test_async_path_streams_the_same_tokens_as_mlx_lm(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model, enable_prefix_cache=False)

    async def scenario() -> list[list[Any]]:
        await engine.start()
        ids = [
            await engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            for p in PROMPTS[:8]
        ]
        streams = await asyncio.gather(*(collect(engine, rid) for rid in ids))
        await engine.stop()
        return streams

    streams = run(scenario())
    for prompt, outputs in zip(PROMPTS[:8], streams, strict=True):
        final = outputs[-1]
        assert final.finished and [o.finished for o in outputs].count(True) == 1
        streamed_ids = [t for o in outputs for t in o.new_token_ids]
        assert (
            streamed_ids
            == final.output_token_ids
            == reference_tokens(tiny_model, prompt, MAX_TOKENS)
        )
        assert "".join(o.new_text for o in outputs) == final.output_text
        assert final.completion_tokens == len(final.output_token_ids)
        assert final.ttft is not None and final.ttft > 0


def test_per_request_sampling_in_one_batch(tiny_model: Any, make_engine: MakeEngine) -> None:
    """Greedy, top-k=1 and hot sampling share a batch; each keeps its own behaviour."""
    prompt = PROMPTS[1]
    expected = reference_tokens(tiny_model, prompt, MAX_TOKENS)
    engine = make_engine(tiny_model, enable_prefix_cache=False)

    async def scenario() -> dict[str, list[int]]:
        requests = {
            "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            "top1": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, top_k=1, seed=1),
            "hot-a": SamplingParams(max_tokens=MAX_TOKENS, temperature=5.0, top_p=1.0, seed=7),
            "hot-b": SamplingParams(max_tokens=MAX_TOKENS, temperature=5.0, top_p=1.0, seed=8),
        }
        for rid, params in requests.items():
            await engine.add_request(prompt, params, request_id=rid)
        finals = {rid: (await collect(engine, rid))[-1] for rid in requests}
        await engine.stop()
        return {rid: out.output_token_ids for rid, out in finals.items()}

    tokens = run(scenario())
    assert tokens["greedy"] == expected
    assert tokens["top1"] == expected  # top-k 1 is argmax whatever the temperature
    assert tokens["hot-a"] != expected and tokens["hot-b"] != expected
    assert tokens["hot-a"] != tokens["hot-b"]  # different seeds, different samples


def test_seed_reproduces_text_whatever_the_batch(tiny_model: Any, make_engine: MakeEngine) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=1234)
    engine = make_engine(tiny_model, enable_prefix_cache=False)
    alone = engine.generate_batch_sync([PROMPTS[2]], params)[0]
    crowded = engine.generate_batch_sync([PROMPTS[0], PROMPTS[2], PROMPTS[5]], params)[1]
    other_seed = engine.generate_batch_sync(
        [PROMPTS[2]],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=99),
    )[0]
    assert alone.output_text == crowded.output_text
    assert alone.output_token_ids == crowded.output_token_ids
    assert other_seed.output_token_ids != alone.output_token_ids


def _split_stop_string(tokenizer: Any, tokens: list[int]) -> str:
    """A stop string made of the end of one token's text and the start of the next one's."""
    pieces = [tokenizer.decode([t]) for t in tokens]
    for left, right in itertools.pairwise(pieces[2:]):
        clean = all(p.strip() and p.isprintable() and "\ufffd" not in p for p in (left, right))
        if clean and len(left) >= 2:
            return left[-2:] + right[:2]
    raise AssertionError("no printable token pair to build a stop string from")


def test_stop_string_split_across_tokens_never_leaks(tiny_model: Any, engine: EngineCore) -> None:
    _, tokenizer = tiny_model
    prompt = PROMPTS[8]
    tokens = reference_tokens(tiny_model, prompt, 24)
    stop = _split_stop_string(tokenizer, tokens)
    full_text = detokenized(tokenizer, tokens)
    assert stop in full_text
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=[stop, "never-there"])
    outputs = run(stream_one(engine, prompt, params))
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.output_text == full_text[: full_text.index(stop)]
    assert all(output.stop_reason is None for output in outputs[:-1])
    streamed = "".join(o.new_text for o in outputs)
    assert streamed == final.output_text and stop not in streamed
    for output in outputs:  # no delta ever carried (part of) the stop string past the cut
        assert stop not in output.output_text


def test_stop_token_ids_are_per_request(tiny_model: Any, make_engine: MakeEngine) -> None:
    prompt = PROMPTS[1]
    tokens = reference_tokens(tiny_model, prompt, MAX_TOKENS)
    # The first token that is new in the continuation: stopping there cuts the output short.
    stop_at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    stop_token = tokens[stop_at]
    engine = make_engine(tiny_model, enable_prefix_cache=False)

    async def scenario() -> tuple[Any, Any]:
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        a = await engine.add_request(
            prompt,
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop_token]),
        )
        b = await engine.add_request(prompt, greedy)
        result = (await collect(engine, a))[-1], (await collect(engine, b))[-1]
        await engine.stop()
        return result

    stopped, unaffected = run(scenario())
    assert stopped.finish_reason == "stop"
    assert stopped.output_token_ids == tokens[:stop_at]
    assert unaffected.finish_reason == "length"
    assert unaffected.output_token_ids == tokens


def test_logprobs_with_top_alternatives(engine: EngineCore) -> None:
    output = engine.generate_batch_sync(
        [PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    )[0]
    plain = engine.generate_batch_sync(
        [PROMPTS[0]],
        SamplingParams(max_tokens=6, temperature=0.0),
    )[0]
    assert plain.logprobs is None
    assert output.logprobs is not None and len(output.logprobs) == 6
    for token, entry in zip(output.output_token_ids, output.logprobs, strict=True):
        assert entry.token_id == token
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        best_token, best_logprob = entry.top_logprobs[0]
        assert best_token == token  # greedy picks the most likely token
        assert best_logprob == pytest.approx(entry.logprob)
        values = [lp for _, lp in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_logprobs_of_rows_in_one_step_are_each_rows_own(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """The step's logprobs are computed for all its rows together: rows asking for 0, 2 and 20
    alternatives beside one asking for none and a sampled one each get their own, equal to
    the same request's alone (a mixed-up row, or a top count taken from another row, fails)."""
    asked = [0, 2, None, 20, 5]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0 if i != 4 else 1.0, seed=7, logprobs=top)
        for i, top in enumerate(asked)
    ]

    async def streamed(engine: EngineCore, indices: list[int]) -> list[tuple[list[int], Any]]:
        """Each request's tokens and its outputs' logprobs joined (None where none came)."""
        ids = [await engine.add_request(PROMPTS[i], params[i]) for i in indices]
        streams = await asyncio.gather(*(collect(engine, request_id) for request_id in ids))
        await engine.stop()
        return [
            (
                stream[-1].output_token_ids,
                None
                if all(o.logprobs is None for o in stream)
                else [entry for o in stream for entry in o.logprobs or []],
            )
            for stream in streams
        ]

    together = run(streamed(make_engine(tiny_model, max_num_seqs=8), list(range(len(asked)))))
    for index, top in enumerate(asked):
        ((alone_tokens, alone),) = run(streamed(make_engine(tiny_model, max_num_seqs=8), [index]))
        tokens, ours = together[index]
        assert tokens == alone_tokens
        if top is None:
            assert ours is None
            continue
        assert ours is not None and alone is not None
        assert len(ours) == len(tokens) == 6
        for entry, single, token in zip(ours, alone, tokens, strict=True):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(single.logprob, abs=1e-4)
            assert len(entry.top_logprobs) == top
            assert [t for t, _ in entry.top_logprobs] == [t for t, _ in single.top_logprobs]
            values = [v for _, v in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
            assert values == pytest.approx([v for _, v in single.top_logprobs], abs=1e-4)


def test_penalties_change_a_repetitive_continuation(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    prompt = PROMPTS[11]
    base = reference_tokens(tiny_model, prompt, 24)
    assert len(set(base)) < len(base)  # the random model repeats itself
    engine = make_engine(tiny_model, enable_prefix_cache=False)
    outputs = (
        engine.generate_batch_sync(
            [prompt], SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=5.0)
        )
        + engine.generate_batch_sync(
            [prompt], SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=50.0)
        )
        + engine.generate_batch_sync(
            [prompt], SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=50.0)
        )
    )
    for output in outputs:
        assert output.output_token_ids != base
        assert len(set(output.output_token_ids)) > len(set(base))


def test_stream_interval_coalesces_without_losing_tokens(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model, stream_interval=3)
    outputs = run(stream_one(engine, PROMPTS[4], SamplingParams(max_tokens=10, temperature=0.0)))
    final = outputs[-1]
    assert final.output_token_ids == reference_tokens(tiny_model, PROMPTS[4], 10)
    assert [t for o in outputs for t in o.new_token_ids] == final.output_token_ids
    assert "".join(o.new_text for o in outputs) == final.output_text
    assert [o.completion_tokens for o in outputs] == [3, 6, 9, 10]
    # Each output's cumulative fields stay what they were when it was made (read after the
    # request has finished): the deltas up to it, never the tokens that came later.
    for i, output in enumerate(outputs):
        assert output.output_token_ids == [t for o in outputs[: i + 1] for t in o.new_token_ids]
        assert output.output_text == "".join(o.new_text for o in outputs[: i + 1])


def test_sixty_four_concurrent_requests_all_finish(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model, max_num_seqs=32, prefill_batch_size=16)

    async def scenario() -> list[Any]:
        ids = [
            await engine.add_request(
                PROMPTS[i % len(PROMPTS)],
                SamplingParams(max_tokens=4 + i % 9, temperature=0.0 if i % 2 else 0.8, seed=i),
            )
            for i in range(64)
        ]
        finals = await asyncio.gather(*(collect(engine, rid) for rid in ids))
        stats = engine.get_stats()
        await engine.stop()
        return [f[-1] for f in finals] + [stats]

    *finals, stats = run(scenario())
    assert len(finals) == 64
    for i, final in enumerate(finals):
        assert final.finished and final.finish_reason == "length"
        assert final.completion_tokens == 4 + i % 9
    assert stats["active_requests"] == 0 and stats["num_running"] == 0
    assert stats["num_waiting"] == 0 and stats["requests"] == []
    # The step time splits into the model's share and the engine's own host work.
    assert 0 < stats["model_seconds"] < stats["step_seconds"]
