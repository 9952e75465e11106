"""Rows join and leave a decode batch in place (engine/row_slots.py).

Short requests come and go beside long streams. A finished row leaves a vacancy instead of a
copy of the batch, a joining group is written into vacancies, and the vacancies are compacted
once they have cost about a step. Every request's greedy tokens must be the ones it makes
alone: a row written into a vacancy must see exactly its own context (right-aligned, the stale
cells before it masked, its own positions), and the rows beside it must not notice."""

from __future__ import annotations

import math
from typing import Any

from mlx_redis_worker.engine.config import SchedulerConfig
from mlx_redis_worker.engine.request import Request
from mlx_redis_worker.engine.row_slots import RowSlotCounters
from mlx_redis_worker.engine.scheduler import Scheduler
from tests.engine.test_stall_free import endless, greedy, tokens_of_length

STREAMS = 4
STREAM_PROMPT = 40
STEPS = 48
# (step it arrives at, prompt tokens, tokens it generates): short chats beside the streams,
# one prompt longer than the batch's window (it cannot join in place).
SHORT = [(2, 12, 3), (7, 9, 4), (13, 14, 3), (18, 120, 4), (25, 10, 3), (30, 8, 4)]

# No stall bound: each prompt prefills in the step it arrives at, so what happens at each step
# does not depend on this machine's measured speeds.
CONFIG = SchedulerConfig(
    enable_prefix_cache=False, max_num_seqs=8, prefill_batch_size=8, max_prefill_stall=math.inf
)


def run(
    tiny_model: Any, stream: Any, requests: list[tuple[int, Request]], steps: int
) -> tuple[dict[str, list[int]], RowSlotCounters, list[tuple[int, int]]]:
    """Step a scheduler, adding each request at its step: every request's tokens, the slot
    counters, and (live rows, rows in the cache) of the decode batches after each step."""
    model, tokenizer = tiny_model
    scheduler = Scheduler(model, tokenizer, CONFIG)
    scheduler.attach_stream(stream)
    generator = scheduler._ensure_generator()
    tokens: dict[str, list[int]] = {request.request_id: [] for _, request in requests}
    shapes: list[tuple[int, int]] = []
    for step in range(steps):
        for at, request in requests:
            if at == step:
                scheduler.add_request(request)
        for output in scheduler.step().outputs:
            tokens[output.request_id] += output.new_token_ids
        batches = list(generator._decode_batches)
        shapes.append((sum(len(b) for b in batches), sum(b.rows_in_cache for b in batches)))
    scheduler.abort_all()
    scheduler.close()
    return tokens, generator.slot_counters, shapes


def test_rows_join_and_leave_in_place_and_every_request_keeps_its_tokens(
    tiny_model: Any, on_a_stream: Any
) -> None:
    _, tokenizer = tiny_model

    def streams() -> list[tuple[int, Request]]:
        return [
            (
                0,
                Request(
                    f"stream{i}", tokens_of_length(tokenizer, STREAM_PROMPT, i), endless(tokenizer)
                ),
            )
            for i in range(STREAMS)
        ]

    def short(i: int) -> Request:
        _, prompt, generated = SHORT[i]
        return Request(f"short{i}", tokens_of_length(tokenizer, prompt, 20 + i), greedy(generated))

    together, counters, shapes = run(
        tiny_model,
        on_a_stream,
        streams() + [(at, short(i)) for i, (at, _, _) in enumerate(SHORT)],
        STEPS,
    )
    alone, _, _ = run(tiny_model, on_a_stream, streams(), STEPS)
    for i in range(STREAMS):
        name = f"stream{i}"
        assert together[name] == alone[name][: len(together[name])]
        assert len(together[name]) >= STEPS - 4
    for i, (_, _, generated) in enumerate(SHORT):
        by_itself, _, _ = run(tiny_model, on_a_stream, [(0, short(i))], generated + 4)
        assert together[f"short{i}"] == by_itself[f"short{i}"], f"short{i}"
        assert len(by_itself[f"short{i}"]) == generated

    # Short chats joined vacancies the earlier ones left; the long prompt could not.
    assert counters.joined_in_place >= 3
    assert counters.joined_by_copy >= 1
    # Far fewer copies than rows leaving (7), and the vacancies were all compacted once the
    # short requests were gone: the streams alone again, with no rows but theirs.
    assert counters.joined_by_copy + counters.compactions < len(SHORT)
    assert counters.compactions >= 1
    assert any(cached > live for live, cached in shapes)
    assert shapes[-1] == (STREAMS, STREAMS)
