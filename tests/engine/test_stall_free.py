"""Stall-free scheduling: running streams advance every step while long prompts prefill.

Counted in engine steps, never seconds: whatever the machine's speed, a running sequence gets
a token in every step, a prompt in prefill progresses by at least ``min_prefill_tokens`` a
step, an abort frees its slot before the next step, and a short prompt is not held behind a
long one. The pace's budget arithmetic is checked on its own with synthetic timings.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_redis_worker.engine.config import SchedulerConfig
from mlx_redis_worker.engine.prefill_pace import (
    CHAT_SHARE,
    FLOOR_FRACTION,
    SHORT_PASS_STEPS,
    PrefillPace,
)
from mlx_redis_worker.engine.request import Request, SamplingParams
from mlx_redis_worker.engine.scheduler import Scheduler
from tests.support.engines import MakeEngine, reference_tokens

LONG = 20_000  # a coding agent's ordinary prompt


def tokens_of_length(tokenizer: Any, length: int, seed: int = 0) -> list[int]:
    vocab = [t for t in range(100, 2000) if t not in set(tokenizer.eos_token_ids)]
    return [vocab[(7 * seed + 13 * i) % len(vocab)] for i in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def endless(tokenizer: Any) -> SamplingParams:
    """Greedy with the model's EOS masked out: a stream that runs until it is aborted."""
    eos = mx.array(sorted(tokenizer.eos_token_ids))

    def no_eos(tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, eos].add(-mx.inf)

    return SamplingParams(max_tokens=1_000_000, temperature=0.0, logits_processors=[no_eos])


def scheduler_over(tiny_model: Any, stream: Any, **config: Any) -> Scheduler:
    model, tokenizer = tiny_model
    config.setdefault("max_prefill_wait", 3600.0)
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(enable_prefix_cache=False, **config))
    scheduler.attach_stream(stream)
    return scheduler


def start_stream(scheduler: Scheduler, tokenizer: Any) -> None:
    """Add request ``stream`` and step past the step that feeds its first token back through
    the model (it streams nothing): from then on it gets a token a step."""
    scheduler.add_request(Request("stream", tokens_of_length(tokenizer, 12), endless(tokenizer)))
    streamed = 0
    while streamed < 2:
        streamed += sum(len(o.new_token_ids) for o in scheduler.step().outputs)


def prefilled_tokens(scheduler: Scheduler) -> int:
    generator = scheduler._generator
    assert generator is not None
    return int(generator.last_prefill_tokens)


def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """The default budget, from this machine's measured speeds: the stream is never skipped
    while a 20k-token prompt prefills, which progresses in passes of at least
    ``min_prefill_tokens`` as its credit pays for them (its first steps: prefilling all of it
    takes minutes on a loaded 2-core CPU, the next test follows a prompt to its end). Where
    such a pass would outlast a decode step, down to a quarter of that floor."""
    scheduler = scheduler_over(tiny_model, on_a_stream)
    tokenizer = tiny_model[1]
    start_stream(scheduler, tokenizer)
    scheduler.add_request(Request("long", tokens_of_length(tokenizer, LONG, 1), greedy(2)))
    floor = math.ceil(SchedulerConfig().min_prefill_tokens * FLOOR_FRACTION)
    passes = 0
    step = 0
    # Until its second pass: a pass slowed by the machine's load is paid back from the credit
    # over more steps (24 steps held two passes on an idle machine, one under two CPU burners).
    while passes < 2:
        step += 1
        assert step <= 400, "the long prompt did not progress"
        outputs = {o.request_id: o for o in scheduler.step().outputs}
        assert len(outputs["stream"].new_token_ids) == 1, f"step {step}: the stream stalled"
        assert "long" not in outputs
        tokens = prefilled_tokens(scheduler)
        assert tokens == 0 or tokens >= floor
        passes += tokens > 0
    stats = scheduler.stats().prefill_pace
    assert stats is not None and stats.decode_step_seconds > 0
    assert stats.prefill_tokens_per_second > 0
    scheduler.abort_all()
    scheduler.close()


def test_a_long_prompt_beside_a_stream_progresses_to_its_end(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """In passes of at least the floor (a quarter of ``min_prefill_tokens`` where a pass of
    that would outlast a decode step), as the stall credit pays for them; the stream gets a
    token every step."""
    scheduler = scheduler_over(tiny_model, on_a_stream)
    tokenizer = tiny_model[1]
    start_stream(scheduler, tokenizer)
    length = 1000
    scheduler.add_request(Request("long", tokens_of_length(tokenizer, length, 1), greedy(2)))
    floor = math.ceil(SchedulerConfig().min_prefill_tokens * FLOOR_FRACTION)
    progress: list[int] = []
    outputs: dict[str, Any] = {}
    while "long" not in outputs:
        outputs = {o.request_id: o for o in scheduler.step().outputs}
        assert len(outputs["stream"].new_token_ids) == 1, f"step {len(progress)}: stalled"
        progress.append(prefilled_tokens(scheduler))
        # Steps between passes: as many as a pass of the floor takes decode steps (the
        # measured speeds); bounded here only against a prompt that never ends.
        assert len(progress) <= 200 * math.ceil(length / floor)
    assert outputs["long"].new_token_ids  # its first token, in the step its prefill ended
    # Every pass but the last (the prompt's remainder) prefilled at least the floor.
    passes = [tokens for tokens in progress if tokens]
    assert min(passes[:-1], default=floor) >= floor
    assert len(passes) <= math.ceil(length / floor)
    assert sum(progress) == length
    scheduler.abort_all()
    scheduler.close()


def test_an_abort_mid_prefill_frees_the_slot_before_the_next_chunk(
    tiny_model: Any, on_a_stream: Any
) -> None:
    chunk = 1024  # a fixed budget: min = max
    scheduler = scheduler_over(
        tiny_model,
        on_a_stream,
        prefill_step_size=chunk,
        min_prefill_tokens=chunk,
        max_prefill_stall=math.inf,
        max_num_seqs=2,
    )
    tokenizer = tiny_model[1]
    start_stream(scheduler, tokenizer)
    scheduler.add_request(Request("long", tokens_of_length(tokenizer, LONG, 1), greedy(2)))
    for _ in range(3):
        scheduler.step()
        assert prefilled_tokens(scheduler) == chunk
    assert scheduler.num_running == 2
    scheduler.add_request(Request("next", tokens_of_length(tokenizer, 20, 2), greedy(2)))
    assert scheduler.abort_request("long")
    # The next step has no chunk of it: its slot goes to the waiting request, whose prompt is
    # prefilled in that step (its first token with it) beside the stream's decode.
    outputs = {o.request_id: o for o in scheduler.step().outputs}
    assert outputs["long"].finish_reason == "abort"
    assert outputs["next"].new_token_ids and len(outputs["stream"].new_token_ids) == 1
    assert prefilled_tokens(scheduler) == 20
    scheduler.abort_all()
    scheduler.close()


def test_an_abort_through_the_engine_lands_within_one_step_of_a_long_prefill(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    chunk = 1024
    engine = make_engine(
        tiny_model, prefill_step_size=chunk, min_prefill_tokens=chunk, max_prefill_stall=math.inf
    )
    tokenizer = tiny_model[1]

    async def scenario() -> tuple[str | None, int]:
        await engine.start()
        stream_id = await engine.add_request(tokens_of_length(tokenizer, 12), endless(tokenizer))
        stream = engine.stream_outputs(stream_id)
        await anext(stream)  # the stream decodes
        long_id = await engine.add_request(tokens_of_length(tokenizer, LONG, 1), greedy(2))
        await anext(stream)  # a step with the long prompt's first chunk has run
        before = engine.stats().steps_executed
        assert await engine.abort_request(long_id)
        after = engine.stats().steps_executed
        outputs = [o async for o in engine.stream_outputs(long_id)]
        await engine.abort_request(stream_id)
        async for _ in stream:  # to its final abort output
            pass
        await engine.stop()
        return outputs[-1].finish_reason, after - before

    reason, steps = asyncio.run(scenario())
    # The abort waits for the step in progress at most: one chunk, never the whole prompt.
    assert reason == "abort" and steps <= 1


def test_a_short_prompt_is_not_held_behind_a_long_one_in_prefill(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """The long prompt's chunks are bounded while the stream decodes; a short prompt arriving
    meanwhile takes a free row of the prefill batch and leaves with its first token at once,
    long before the long prompt is done."""
    chunk = 256
    scheduler = scheduler_over(
        tiny_model,
        on_a_stream,
        prefill_step_size=chunk,
        min_prefill_tokens=chunk,
        max_prefill_stall=math.inf,
    )
    tokenizer = tiny_model[1]
    start_stream(scheduler, tokenizer)
    long = 4 * chunk
    scheduler.add_request(Request("long", tokens_of_length(tokenizer, long, 1), greedy(2)))
    scheduler.step()
    short = tokens_of_length(tokenizer, 30, 2)
    scheduler.add_request(Request("short", short, greedy(3)))
    firsts: dict[str, int] = {}
    tokens: list[int] = []
    passes: list[int] = []
    step = 1
    while "long" not in firsts:
        step += 1
        for output in scheduler.step().outputs:
            if output.new_token_ids:
                firsts.setdefault(output.request_id, step)
            if output.request_id == "short":
                tokens += output.new_token_ids
        passes.append(prefilled_tokens(scheduler))
        assert step < 20
    # Joined beside a prompt part-way through its prefill (padded to its length), the short
    # one's greedy tokens are still mlx-lm's.
    assert tokens == reference_tokens(tiny_model, short, 3)
    # The short prompt takes the short prompts' lane: in step 2 a pass of its 30 tokens alone
    # (in one prompt batch the long row rode in it, 2 x 30; before that the short one's
    # first token waited for a pass of 2 x 128 rows), then the long one's 256 a step: 512,
    # 768, and its last 256 with its last token in step 5.
    assert passes[0] == 30
    assert {r: firsts[r] for r in ("short", "long")} == {"short": 2, "long": 5}
    scheduler.abort_all()
    scheduler.close()


def test_short_prompts_prefill_in_a_lane_of_their_own_beside_long_ones(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """Four prompts of more than a chunk each fill the long prompts' lane; two short prompts
    arriving behind them take the short lane and leave with their first tokens in the next
    step, from a pass of their own: 2 x 30 tokens, the long rows left out and their caches
    untouched (in one prompt batch the long prompts held three of the four rows, the short
    ones took the last one in turn, each in a pass as wide as every long row's: 4 x 30).
    The long prompts then end with mlx-lm's own greedy tokens."""
    chunk = 64
    scheduler = scheduler_over(
        tiny_model,
        on_a_stream,
        prefill_step_size=chunk,
        prefill_batch_size=4,
        max_prefill_stall=math.inf,
    )
    tokenizer = tiny_model[1]
    longs = {f"long{i}": tokens_of_length(tokenizer, 5 * chunk, i + 10) for i in range(4)}
    for name, prompt in longs.items():
        scheduler.add_request(Request(name, prompt, greedy(2)))
    scheduler.step()
    assert scheduler._generator is not None and scheduler._generator.num_prefilling == 4
    shorts = ["short0", "short1"]
    for i, name in enumerate(shorts):
        scheduler.add_request(Request(name, tokens_of_length(tokenizer, 30, i + 2), greedy(2)))
    first = scheduler.step().outputs
    assert {o.request_id for o in first if o.new_token_ids} == set(shorts)
    assert prefilled_tokens(scheduler) == 2 * 30
    tokens: dict[str, list[int]] = {name: [] for name in longs}
    for _ in range(40):
        for output in scheduler.step().outputs:
            tokens.get(output.request_id, []).extend(output.new_token_ids)
        if not scheduler.has_requests():
            break
    assert tokens == {name: reference_tokens(tiny_model, p, 2) for name, p in longs.items()}
    scheduler.close()


def test_with_nothing_decoding_a_pass_takes_about_max_prefill_pass(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """A new request is admitted and an abort applied only between passes: with nothing
    decoding, a pass prefills what the measured speed does in ``max_prefill_pass``, not a whole
    chunk (here a time so short that the floor binds once the speed is measured)."""
    scheduler = scheduler_over(
        tiny_model,
        on_a_stream,
        prefill_step_size=256,
        min_prefill_tokens=16,
        max_prefill_pass=1e-9,
    )
    tokenizer = tiny_model[1]
    scheduler.add_request(Request("long", tokens_of_length(tokenizer, 1000, 1), greedy(2)))
    passes = []
    for _ in range(4):
        scheduler.step()
        passes.append(prefilled_tokens(scheduler))
    assert passes == [256, 16, 16, 16]  # the first, unmeasured: a whole chunk
    scheduler.abort_all()
    scheduler.close()


# -- bursts -----------------------------------------------------------------------------------


def burst_firsts(
    scheduler: Scheduler, names: list[str], streams: tuple[str, ...] = (), limit: int = 60
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Step until every request of ``names`` has its first token: the step of each one's
    first token, and the steps in which each of ``streams`` (and of ``names``) got tokens."""
    firsts: dict[str, int] = {}
    tokens_at: dict[str, list[int]] = {name: [] for name in (*names, *streams)}
    step = 0
    while len(firsts) < len(names):
        step += 1
        assert step <= limit
        for output in scheduler.step().outputs:
            if output.new_token_ids:
                if output.request_id in names:
                    firsts.setdefault(output.request_id, step)
                tokens_at[output.request_id].append(step)
    return firsts, tokens_at


def add_burst(scheduler: Scheduler, tokenizer: Any, lengths: list[int]) -> list[str]:
    names = [f"b{i}" for i in range(len(lengths))]
    for i, (name, length) in enumerate(zip(names, lengths, strict=True)):
        scheduler.add_request(Request(name, tokens_of_length(tokenizer, length, i + 3), greedy(8)))
    return names


def test_a_burst_s_prefill_runs_without_decode_steps_between_its_groups(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """Twelve prompts arriving together, no stream running before them: each step prefills a
    group of four and no step decodes until the last group has its first tokens (the first
    groups' streams started in this burst: the stall bound does not hold the burst back for
    them, while ``max_prefill_wait`` allows; here an hour)."""
    scheduler = scheduler_over(tiny_model, on_a_stream, max_num_seqs=16, prefill_batch_size=4)
    names = add_burst(scheduler, tiny_model[1], [30] * 12)
    firsts, tokens_at = burst_firsts(scheduler, names)
    assert sorted(firsts.values()) == [1] * 4 + [2] * 4 + [3] * 4
    # Steps 2 and 3 decoded nothing: the first group's only token is its first.
    first_group = [name for name in names if firsts[name] == 1]
    assert all(tokens_at[name] == [1] for name in first_group)
    assert scheduler.pace.burst_steps == 2
    scheduler.abort_all()
    scheduler.close()


def wide_burst(tiny_model: Any, stream: Any, **config: Any) -> tuple[Scheduler, list[str]]:
    """Twelve prompts of 30 tokens arriving together into a prompt batch of twelve rows, with
    a chunk (64) that holds two of them: a pass bounded by a chunk in all takes two rows."""
    scheduler = scheduler_over(
        tiny_model,
        stream,
        max_num_seqs=16,
        prefill_batch_size=12,
        prefill_step_size=64,
        **config,
    )
    return scheduler, add_burst(scheduler, tiny_model[1], [30] * 12)


def test_a_burst_of_short_prompts_starts_in_one_pass_where_its_speed_allows(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """With nothing decoding and the prefill speed measured, a pass that ends every short
    prompt in prefill (each row's chunk at most ``prefill_step_size``, 360 tokens in all) is
    taken whole where it fits in ``max_prefill_wait``: the burst's twelve streams start, and
    decode, together (a pass bounded by a chunk in all started them two by two, six groups)."""
    scheduler, names = wide_burst(tiny_model, on_a_stream)
    scheduler.pace.observe_prefill(10_000, 1.0)  # measured: 360 tokens take 36 ms
    firsts, _ = burst_firsts(scheduler, names)
    assert sorted(firsts.values()) == [1] * 12
    assert prefilled_tokens(scheduler) == 12 * 30
    scheduler.abort_all()
    scheduler.close()


def test_a_burst_s_step_ends_the_rest_of_its_short_prompts_in_one_pass(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """The first pass of a fresh engine (speed not measured) takes a chunk, two rows; the
    next step, a burst step, ends the other ten in one pass (each row's chunk within the
    chunk size, the pass within the burst's slack), not two by two."""
    scheduler, names = wide_burst(tiny_model, on_a_stream)
    firsts, _ = burst_firsts(scheduler, names)
    assert sorted(firsts.values()) == [1] * 2 + [2] * 10
    assert scheduler.pace.burst_steps == 1
    scheduler.abort_all()
    scheduler.close()


def test_a_whole_pass_that_would_outlast_max_prefill_wait_is_not_taken(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """The same burst where the measured speed says the whole pass (360 tokens) takes longer
    than ``max_prefill_wait``: passes stay a chunk (two rows) each, and a request arriving
    meanwhile waits for one of those, not for the whole burst's prefill."""
    scheduler, _ = wide_burst(tiny_model, on_a_stream, max_prefill_wait=0.1, max_prefill_pass=0.0)
    scheduler.pace.observe_prefill(1_000, 1.0)  # 360 tokens take 0.36 s
    scheduler.step()
    assert prefilled_tokens(scheduler) == 2 * 30
    scheduler.abort_all()
    scheduler.close()


def test_a_chat_burst_beside_another_tenant_s_long_prompt_keeps_its_burst_steps(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """Eight chat prompts arrive together while another tenant's long prompt is in prefill
    (in the long lane since before them): four get their first tokens in the first pass, the
    other four in the next step, a burst step. The long prompt is not of the burst; before,
    it made the burst's later prompts wait for the stall credit beside the first ones' decode
    (in bench isolation, a victim's TTFT 2-2.5x its own alone)."""
    chunk = 128
    scheduler = scheduler_over(
        tiny_model,
        on_a_stream,
        max_num_seqs=16,
        prefill_batch_size=4,
        prefill_step_size=chunk,
        max_prefill_pass=0.0,
    )
    tokenizer = tiny_model[1]
    scheduler.add_request(Request("long", tokens_of_length(tokenizer, 8 * chunk, 1), greedy(2)))
    for _ in range(2):  # its first chunks: in prefill before the burst arrives
        scheduler.step()
    names = add_burst(scheduler, tokenizer, [30] * 8)
    firsts, tokens_at = burst_firsts(scheduler, names)
    assert sorted(firsts.values()) == [1] * 4 + [2] * 4
    # Step 2 prefilled the burst's rest and decoded nothing (the old code decoded the first
    # four beside a pass paid from the stall credit).
    assert all(tokens_at[name] == [1] for name in names if firsts[name] == 1)
    assert scheduler.pace.burst_steps == 1
    scheduler.abort_all()
    scheduler.close()


def test_a_stream_running_before_a_burst_gets_a_token_every_step_of_it(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """The same burst behind a stream that was decoding when it arrived: every step decodes,
    the burst's prompts take the bounded budget beside it (a fixed 64 tokens here: min = max),
    and the budget goes to the prompts with the fewest tokens left, so that one first token
    leaves each step (equal shares of 16 would end all four of a group in step 2)."""
    scheduler = scheduler_over(
        tiny_model,
        on_a_stream,
        max_num_seqs=16,
        prefill_batch_size=4,
        prefill_step_size=64,
        min_prefill_tokens=64,
        max_prefill_stall=math.inf,
    )
    tokenizer = tiny_model[1]
    start_stream(scheduler, tokenizer)
    names = add_burst(scheduler, tokenizer, [40] * 8)
    firsts, tokens_at = burst_firsts(scheduler, names, streams=("stream",))
    steps = max(firsts.values())
    assert tokens_at["stream"] == list(range(1, steps + 1))
    assert sorted(firsts.values()) == list(range(1, 9))
    assert scheduler.pace.burst_steps == 0
    scheduler.abort_all()
    scheduler.close()


def test_a_long_prompt_arriving_with_a_short_one_does_not_freeze_its_stream(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """A short and a long prompt arrive together: the short one's stream started in the same
    burst, but a burst step must end a prompt, so while no pass can end the long one each
    step decodes beside a bounded chunk of it (a long prompt gets the stall bound's chunks
    whoever came first). Its last chunk, which ends it, runs beside a decode too: the stream
    has streamed (more than its first token), and a stream is held by a burst at most once,
    before its second token."""
    chunk = 256
    scheduler = scheduler_over(
        tiny_model,
        on_a_stream,
        prefill_step_size=chunk,
        min_prefill_tokens=chunk,
        max_prefill_stall=math.inf,
    )
    tokenizer = tiny_model[1]
    long = tokens_of_length(tokenizer, 8 * chunk, 1)
    scheduler.add_request(Request("long", long, endless(tokenizer)))
    scheduler.add_request(Request("short", tokens_of_length(tokenizer, 20, 2), endless(tokenizer)))
    firsts, tokens_at = burst_firsts(scheduler, ["short", "long"], limit=20)
    # Step 1 (nothing decoding) shares the chunk: the short prompt's 20 tokens and 128 of the
    # long one's; then 256 a step beside the stream's decode (its first token fed back in
    # step 2), until the last 128, which end the long prompt beside a decode (step 9).
    assert firsts == {"short": 1, "long": 9}
    assert tokens_at["short"] == [1, *range(3, 10)]
    assert scheduler.pace.burst_steps == 0
    scheduler.abort_all()
    scheduler.close()


def test_a_prompt_left_out_of_a_pass_keeps_mlx_lm_s_greedy_tokens(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """Shortest remaining prefill first leaves rows out of a pass (their caches untouched) and
    puts them back: every request's greedy tokens are still mlx-lm's."""
    scheduler = scheduler_over(
        tiny_model, on_a_stream, prefill_step_size=48, max_prefill_stall=math.inf
    )
    tokenizer = tiny_model[1]
    start_stream(scheduler, tokenizer)
    lengths = [45, 30, 70, 12]
    prompts = [tokens_of_length(tokenizer, n, i + 5) for i, n in enumerate(lengths)]
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"p{i}", prompt, greedy(6)))
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    done: set[str] = set()
    for _ in range(40):
        for output in scheduler.step().outputs:
            if output.request_id in tokens:
                tokens[output.request_id] += output.new_token_ids
                if output.finished:
                    done.add(output.request_id)
        if len(done) == len(prompts):
            break
    for i, prompt in enumerate(prompts):
        assert tokens[f"p{i}"] == reference_tokens(tiny_model, prompt, 6), i
    scheduler.abort_all()
    scheduler.close()


def test_the_burst_budget_is_the_tokens_that_fit_the_slack() -> None:
    pace = PrefillPace(max_stall=1.0, min_tokens=32, max_tokens=2048)
    assert pace.burst_budget(10.0) == 0  # prefill speed not measured yet
    pace.observe_prefill(1000, 1.0)
    assert pace.burst_budget(0.5) == 500
    assert pace.burst_budget(100.0) == 2048
    assert pace.burst_budget(-0.1) == 0 and pace.burst_budget(math.nan) == 0


# -- the pace's budget ---------------------------------------------------------------------


def test_each_prompt_lane_has_its_own_prefill_speed() -> None:
    """A narrow pass of short prompts and a pass deep in long ones go at different speeds a
    token: each lane's budget comes from its own, the other's until its first pass is
    measured (not a whole chunk: deep in a 26k-token prompt that pass took 5.2 s on tiny)."""
    pace = PrefillPace(max_stall=1.0, min_tokens=32, max_tokens=2048, max_pass_seconds=0.25)
    pace.observe_prefill(4000, 1.0)
    assert pace.budget(decoding=False) == 1000
    pace.lane = 1
    assert pace.budget(decoding=False) == 1000
    pace.observe_prefill(500, 1.0)
    assert pace.budget(decoding=False) == 125
    pace.lane = 0
    assert pace.budget(decoding=False) == 1000
    # A pass of short prompts beside decoding may take SHORT_PASS_STEPS steady steps.
    pace.observe_decode(0.02)
    assert pace.short_pass_tokens() == round(4000 * SHORT_PASS_STEPS * 0.02)


def test_with_nothing_decoding_or_no_bound_prefill_runs_whole_chunks() -> None:
    pace = PrefillPace(max_stall=1.0, min_tokens=32, max_tokens=2048)
    assert pace.budget(decoding=False) == 2048
    assert pace.budget(decoding=True) == 32  # nothing measured yet: the floor
    assert PrefillPace(math.inf, 32, 2048).budget(decoding=True) == 2048


def test_with_nothing_decoding_a_pass_is_bounded_by_time() -> None:
    pace = PrefillPace(max_stall=1.0, min_tokens=32, max_tokens=2048, max_pass_seconds=1.0)
    assert pace.budget(decoding=False) == 2048  # speed not measured yet
    pace.observe_prefill(500, 1.0)
    assert pace.budget(decoding=False) == 500
    pace.observe_prefill(10, 1.0)
    pace.observe_prefill(10, 1.0)
    assert pace.budget(decoding=False) >= 32  # never below the floor
    assert PrefillPace(math.inf, 32, 2048, max_pass_seconds=1.0).budget(decoding=False) == 2048


def test_the_budget_settles_where_a_step_s_prefill_takes_the_stall() -> None:
    """A pass costs a fixed 4 ms plus 50 µs a token, a decode step 10 ms: with a stall of 1.0
    the budget converges to the 120 tokens whose pass takes 10 ms; with 2.0, to 320."""
    for stall, settled in ((1.0, 120), (2.0, 320)):
        pace = PrefillPace(max_stall=stall, min_tokens=32, max_tokens=2048)
        for _ in range(60):
            pace.observe_decode(0.010)
            pace.earn()
            tokens = pace.budget(decoding=True)
            pace.observe_prefill(tokens, 0.004 + 50e-6 * tokens)
            pace.spend(0.004 + 50e-6 * tokens)
        pace.earn()
        assert abs(pace.budget(decoding=True) - settled) <= 2


def test_where_the_floor_s_pass_outlasts_a_decode_step_the_floor_shrinks() -> None:
    """Deep in a long prompt a pass of ``min_tokens`` (32) takes 4 decode steps here: passes
    take what one decode step's time does (8 tokens), down to a quarter of the floor and no
    lower; where the floor's pass fits in a step, the floor stays."""
    for pass_ms_per_token, floor in ((0.5, 32), (2.5, 8), (10.0, 8), (1.25, 16)):
        pace = PrefillPace(max_stall=0.2, min_tokens=32, max_tokens=2048)
        pace.observe_prefill(32, 32 * pass_ms_per_token / 1000)
        passes = []
        for _ in range(400):
            pace.observe_decode(0.020)
            pace.earn()
            tokens = pace.budget(decoding=True)
            if tokens:
                passes.append(tokens)
                seconds = tokens * pass_ms_per_token / 1000
                pace.observe_prefill(tokens, seconds)
                pace.spend(seconds)
        assert pace.floor == floor, pass_ms_per_token
        assert passes and min(passes) >= floor
        # No pass is longer than a decode step, or than the quarter floor's where that is.
        assert max(passes) * pass_ms_per_token <= max(20.0, floor * pass_ms_per_token) * 1.01
        # Prefill kept its share of the time: the stall (0.2) of every decode step.
        spent = sum(passes) * pass_ms_per_token / 1000
        assert spent <= 0.2 * 0.020 * 400 + 2 * floor * pass_ms_per_token / 1000


def test_a_pass_too_slow_for_the_stall_waits_for_its_credit() -> None:
    """A pass of the floor (here 8 tokens: a quarter of ``min_tokens``, which a decode step's
    time does not fit) takes 2.5 ms, a decode step 1 ms: with a stall of 1.0 the prompt gets
    one pass of the floor every 3 steps (the credit reaches the floor's 2.5 ms in the third:
    the streams' step is 1.8x on average, not 3.5x every step); with a stall of 0, one every
    20 steps (``MIN_SHARE``: it still progresses)."""
    for stall, every in ((1.0, 3), (0.0, 20)):
        pace = PrefillPace(max_stall=stall, min_tokens=32, max_tokens=2048)
        pace.observe_prefill(32, 0.010)
        passes = []
        for step in range(800):
            pace.observe_decode(0.001)
            pace.earn()
            tokens = pace.budget(decoding=True)
            assert tokens == 0 or tokens >= 8
            if tokens:
                passes.append(step)
                pace.observe_prefill(tokens, 0.010 * tokens / 32)
                pace.spend(0.010 * tokens / 32)
        assert abs(len(passes) - 800 / every) <= 1, (stall, len(passes))


def test_a_chat_prompt_s_pass_is_repaid_at_the_chat_share_a_long_one_s_at_the_stall() -> None:
    """With a stall of 0.2, a decode step of 1 ms and a pass of 4 ms beside it: the steps
    after the pass earn 1 ms each (``CHAT_SHARE``) while the next pass ends a chat-size
    prompt: 4 steps repay it and the fifth earns the next pass; 0.2 ms each otherwise (20
    steps to repay, 5 more to earn a pass of the 1-token floor): 8 chat
    prompts beside another tenant's streams took 4 such passes, and their first tokens came
    4-5x later than with nothing decoding."""
    steps_to_repay = {}
    for chat in (True, False):
        pace = PrefillPace(max_stall=0.2, min_tokens=4, max_tokens=2048)
        pace.observe_prefill(1000, 1.0)  # 1 token a ms: the floor's pass fits a step
        pace.observe_decode(0.001)
        pace.spend(0.004)
        steps = 0
        while pace.budget(decoding=True) == 0:
            pace.observe_decode(0.001)
            pace.earn(chat=chat)
            steps += 1
        steps_to_repay[chat] = steps
    assert CHAT_SHARE == 1.0
    assert steps_to_repay == {True: 4 + 1, False: 20 + 5}


def test_a_chat_prompt_earns_the_chat_share_only_while_no_long_prompt_prefills(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """Beside a stream, a chat prompt's steps earn ``CHAT_SHARE``; beside a long prompt in
    prefill they earn the stall's share, since the long lane's passes would spend the credit
    (on smollm2 a victim beside four 2,300-token prompts kept 0.66 of its speed, 0.91 with
    this rule). The speeds are set, not measured, so the verdicts do not hang on the load."""
    chunk = 64
    scheduler = scheduler_over(tiny_model, on_a_stream, prefill_step_size=chunk)
    tokenizer = tiny_model[1]
    start_stream(scheduler, tokenizer)
    scheduler.add_request(Request("long", tokens_of_length(tokenizer, 4 * chunk, 1), greedy(2)))
    scheduler.add_request(Request("chat", tokens_of_length(tokenizer, 8, 2), greedy(2)))
    generator = scheduler._generator
    assert generator is not None

    def chat_share_earned() -> bool:
        scheduler._admit()  # into the generator, as a step begins
        generator.prepare_pass()  # the queued prompts take their lanes' rows
        pace = scheduler.pace = PrefillPace(max_stall=0.2, min_tokens=4, max_tokens=chunk)
        pace.observe_prefill(1000, 1.0)  # short lane: a short pass is 40 tokens
        pace.observe_decode(0.01)
        pace.lane = 0
        return scheduler._chat_prompt_next(generator)

    assert not chat_share_earned()
    assert generator.long_prompts_in_prefill
    scheduler.abort_request("long")
    assert not generator.long_prompts_in_prefill
    assert chat_share_earned()
    scheduler.abort_all()
    scheduler.close()


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.0, 100.0) | st.just(math.inf),
    st.integers(1, 4096),
    st.integers(1, 4096),
    st.lists(
        st.tuples(
            st.floats(allow_nan=True, allow_infinity=True),
            st.integers(-5, 10**6),
            st.floats(allow_nan=True, allow_infinity=True),
        ),
        max_size=20,
    ),
)
def test_the_budget_is_none_or_between_the_floor_and_the_chunk(
    stall: float, floor: int, chunk: int, samples: list[tuple[float, int, float]]
) -> None:
    pace = PrefillPace(max_stall=stall, min_tokens=floor, max_tokens=chunk)
    for decode, tokens, seconds in samples:
        pace.observe_decode(decode)
        pace.earn()
        pace.observe_prefill(tokens, seconds)
        pace.spend(seconds)
        budget = pace.budget(decoding=True)
        least = max(1, math.ceil(min(floor, chunk) * FLOOR_FRACTION))
        assert budget == 0 or least <= budget <= chunk
        assert least <= pace.floor <= min(floor, chunk)
        assert math.isfinite(pace.credit)
        assert math.isfinite(pace.decode_seconds) and math.isfinite(pace.prefill_rate)


@pytest.mark.parametrize("stall", [float("nan"), -1.0])
def test_a_bad_stall_is_refused(stall: float) -> None:
    with pytest.raises(ValueError, match="max_prefill_stall"):
        SchedulerConfig(max_prefill_stall=stall)
