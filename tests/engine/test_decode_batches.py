"""Decode batches grouped by context length: one long-context stream no longer pads every
other stream's step to its context.

Counted in steps and cache sizes, never seconds: the short streams' batch holds no row of the
long context; they get a token every step; the long stream gets its passes at the share the
stall bound gives it (and at least ``MIN_SHARE``); every stream's greedy tokens are still
mlx-lm's; batches merge again when the long stream leaves.
"""

from __future__ import annotations

import math
from typing import Any

from mlx_redis_worker.engine.prefill_pace import MIN_SHARE
from mlx_redis_worker.engine.request import Request
from mlx_redis_worker.engine.scheduler import Scheduler
from tests.engine.test_stall_free import (
    endless,
    greedy,
    scheduler_over,
    tokens_of_length,
)
from tests.support.engines import reference_tokens

SHORT = ["s0", "s1", "s2", "s3"]
LONG_CONTEXT = 1_200  # far enough from the short ones' to decode apart on tiny


def batch_of(scheduler: Scheduler, request_id: str) -> Any:
    """The decode batch (mlx-lm's GenerationBatch) holding this request's row."""
    generator = scheduler._generator
    assert generator is not None
    uid = scheduler._requests[request_id].uid
    (batch,) = [b for b in generator._decode_batches if uid in b.uids]
    return batch


def padded_context(batch: Any) -> int:
    """The length every row of the batch's KV cache is padded to."""
    return int(batch.prompt_cache[0]._idx)


def run_until_decoding(scheduler: Scheduler, ids: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(ids, 0)
    for _ in range(1500):
        for output in scheduler.step().outputs:
            if output.request_id in counts:
                counts[output.request_id] += len(output.new_token_ids)
        if all(n >= 2 for n in counts.values()):
            return counts
    raise AssertionError(f"not every stream decodes after 1,500 steps: {counts}")


def add_short_and_long(scheduler: Scheduler, tokenizer: Any, long_params: Any = None) -> None:
    for i, request_id in enumerate(SHORT):
        prompt = tokens_of_length(tokenizer, 12, i)
        scheduler.add_request(Request(request_id, prompt, endless(tokenizer)))
    prompt = tokens_of_length(tokenizer, LONG_CONTEXT, 9)
    scheduler.add_request(Request("long", prompt, long_params or endless(tokenizer)))


def test_a_long_context_stream_decodes_apart_and_the_short_ones_every_step(
    tiny_model: Any, on_a_stream: Any
) -> None:
    stall = 1.0
    scheduler = scheduler_over(tiny_model, on_a_stream, max_prefill_stall=stall)
    tokenizer = tiny_model[1]
    add_short_and_long(scheduler, tokenizer)
    run_until_decoding(scheduler, [*SHORT, "long"])
    generator = scheduler._generator
    assert generator is not None
    assert generator.num_decode_batches == 2
    short = batch_of(scheduler, "s0")
    assert sorted(short.uids) == sorted(scheduler._requests[r].uid for r in SHORT)
    # Their cache is padded to their own contexts (12-token prompts and what they streamed
    # while the long prompt prefilled), not to the long stream's.
    assert padded_context(short) <= max(len(tokens) for tokens in short.tokens) + 1
    assert padded_context(short) < LONG_CONTEXT // 2
    assert padded_context(batch_of(scheduler, "long")) >= LONG_CONTEXT

    steps = 60
    got = {request_id: 0 for request_id in [*SHORT, "long"]}
    side_passes = 0
    for _ in range(steps):
        for output in scheduler.step().outputs:
            got[output.request_id] += len(output.new_token_ids)
        side_passes += len(generator.last_decode_plan.batches) - 1
    assert all(got[r] == steps for r in SHORT), got
    # The long batch's pass costs more than a steady step (weights plus 1,200 cells against
    # weights plus 4 short contexts): it runs as often as stall steady steps a step pay for
    # it, never more, and never less than the floor share.
    plan_cost = side_cost_in_steady_steps(scheduler)
    assert plan_cost > 1.0
    assert got["long"] == side_passes
    assert side_passes <= math.ceil(steps * stall / plan_cost) + 1
    assert side_passes >= math.floor(steps * max(stall, MIN_SHARE) / plan_cost) - 1
    scheduler.abort_all()
    scheduler.close()


def side_cost_in_steady_steps(scheduler: Scheduler) -> float:
    generator = scheduler._generator
    assert generator is not None
    batches = generator._decode_batches
    steady, side = batches._batches
    return float(batches._cost(side) / batches._cost(steady))


def test_a_stall_of_zero_still_steps_the_long_context_stream(
    tiny_model: Any, on_a_stream: Any
) -> None:
    scheduler = scheduler_over(tiny_model, on_a_stream, max_prefill_stall=0.0)
    tokenizer = tiny_model[1]
    add_short_and_long(scheduler, tokenizer)
    run_until_decoding(scheduler, [*SHORT, "long"])
    cost = side_cost_in_steady_steps(scheduler)
    steps = math.ceil(2 * cost / MIN_SHARE) + 2
    long_tokens = 0
    for _ in range(steps):
        for output in scheduler.step().outputs:
            if output.request_id == "long":
                long_tokens += len(output.new_token_ids)
    assert long_tokens >= 2
    scheduler.abort_all()
    scheduler.close()


def test_grouped_batches_keep_mlx_lm_s_greedy_tokens_and_merge_when_the_long_one_ends(
    tiny_model: Any, on_a_stream: Any
) -> None:
    scheduler = scheduler_over(tiny_model, on_a_stream, max_prefill_stall=1.0)
    tokenizer = tiny_model[1]
    short_prompts = [tokens_of_length(tokenizer, 12 + 3 * i, i) for i in range(3)]
    long_prompt = tokens_of_length(tokenizer, LONG_CONTEXT, 9)
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(3)} | {"long": []}
    scheduler.add_request(Request("long", long_prompt, greedy(24)))
    for _ in range(1500):  # the long stream decodes first; the short ones join it
        for output in scheduler.step().outputs:
            tokens[output.request_id] += output.new_token_ids
        if tokens["long"]:
            break
    for i, prompt in enumerate(short_prompts):
        scheduler.add_request(Request(f"p{i}", prompt, greedy(24)))
    batches_seen: set[int] = set()
    done: set[str] = set()
    generator = None
    for _ in range(1500):
        for output in scheduler.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                done.add(output.request_id)
        generator = scheduler._generator
        assert generator is not None
        batches_seen.add(generator.num_decode_batches)
        if len(done) == 4:
            break
    assert done == set(tokens)
    assert 2 in batches_seen  # the long stream decoded apart
    for i, prompt in enumerate(short_prompts):
        assert tokens[f"p{i}"] == reference_tokens(tiny_model, prompt, 24), i
    assert tokens["long"] == reference_tokens(tiny_model, long_prompt, 24)
    assert generator is not None and generator.num_decode_batches == 0
    scheduler.close()


def test_the_short_streams_rejoin_one_batch_when_the_long_stream_is_aborted(
    tiny_model: Any, on_a_stream: Any
) -> None:
    scheduler = scheduler_over(tiny_model, on_a_stream)
    tokenizer = tiny_model[1]
    add_short_and_long(scheduler, tokenizer)
    # A fifth short stream that joins after the long one: it goes with the short ones.
    run_until_decoding(scheduler, [*SHORT, "long"])
    scheduler.add_request(Request("late", tokens_of_length(tokenizer, 40, 7), endless(tokenizer)))
    run_until_decoding(scheduler, ["late"])
    generator = scheduler._generator
    assert generator is not None
    assert generator.num_decode_batches == 2
    assert batch_of(scheduler, "late") is batch_of(scheduler, "s0")
    scheduler.abort_request("long")
    scheduler.step()
    assert generator.num_decode_batches == 1
    assert generator.num_decoding == len(SHORT) + 1
    scheduler.abort_all()
    scheduler.close()


def test_with_no_stall_bound_prefill_runs_beside_every_pass(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """``max_prefill_stall`` inf: every decode batch every step and whole chunks beside them
    (a prompt arriving beside a long-context batch is not held for its turn)."""
    scheduler = scheduler_over(tiny_model, on_a_stream, max_prefill_stall=math.inf)
    tokenizer = tiny_model[1]
    add_short_and_long(scheduler, tokenizer)
    run_until_decoding(scheduler, [*SHORT, "long"])
    generator = scheduler._generator
    assert generator is not None and generator.num_decode_batches == 2
    scheduler.add_request(Request("late", tokens_of_length(tokenizer, 300, 7), greedy(4)))
    steps = 0
    while True:
        steps += 1
        outputs = {o.request_id: o for o in scheduler.step().outputs}
        assert len(generator.last_decode_plan.batches) == 2
        if "late" in outputs and outputs["late"].new_token_ids:
            break
        assert steps < 3, "the prompt waited beside the long-context batch"
    scheduler.abort_all()
    scheduler.close()
