"""Rows join and leave a decode batch in place (engine/row_slots.py).

Short requests come and go beside long streams. A finished row leaves a vacancy instead of a
copy of the batch, a joining group is written into vacancies, and the vacancies are compacted
once they have cost about a step. Every request's greedy tokens must be the ones it makes
alone: a row written into a vacancy must see exactly its own context (right-aligned, the stale
cells before it masked, its own positions), and the rows beside it must not notice."""

from __future__ import annotations

import itertools
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
# Copies so costly that no vacancy is compacted for its rent (only for a copy-join), and free
# ones (every vacancy compacted at the next step).
COSTLY_COPIES = 1.0
FREE_COPIES = 0.0

CONFIG = SchedulerConfig(
    enable_prefix_cache=False, max_num_seqs=8, prefill_batch_size=8, max_prefill_stall=math.inf
)


def run(
    tiny_model: Any,
    stream: Any,
    requests: list[tuple[int, Request]],
    steps: int,
    copy_seconds_per_cell: float = COSTLY_COPIES,
) -> tuple[dict[str, list[int]], RowSlotCounters, list[tuple[int, int]]]:
    """Step a scheduler, adding each request at its step: every request's tokens, the slot
    counters, and (live rows, rows in the cache) of the decode batches after each step. The
    copy speed the batches weigh vacancies against is set before every step, so what they
    decide does not depend on this machine's timings."""
    model, tokenizer = tiny_model
    scheduler = Scheduler(model, tokenizer, CONFIG)
    scheduler.attach_stream(stream)
    generator = scheduler._ensure_generator()
    tokens: dict[str, list[int]] = {request.request_id: [] for _, request in requests}
    shapes: list[tuple[int, int]] = []
    for step in range(steps):
        generator.slot_counters.copy_seconds_per_cell = copy_seconds_per_cell
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


def stream_requests(tokenizer: Any) -> list[tuple[int, Request]]:
    """The long streams, new requests each call (a request is spent by the run it is in)."""
    return [
        (
            0,
            Request(
                f"stream{i}", tokens_of_length(tokenizer, STREAM_PROMPT, i), endless(tokenizer)
            ),
        )
        for i in range(STREAMS)
    ]


def short_request(tokenizer: Any, i: int) -> Request:
    _, prompt, generated = SHORT[i]
    return Request(f"short{i}", tokens_of_length(tokenizer, prompt, 20 + i), greedy(generated))


def short_requests(tokenizer: Any) -> list[tuple[int, Request]]:
    return [(at, short_request(tokenizer, i)) for i, (at, _, _) in enumerate(SHORT)]


def test_rows_join_and_leave_in_place_and_every_request_keeps_its_tokens(
    tiny_model: Any, on_a_stream: Any
) -> None:
    _, tokenizer = tiny_model
    together, counters, shapes = run(
        tiny_model, on_a_stream, stream_requests(tokenizer) + short_requests(tokenizer), STEPS
    )
    alone, _, _ = run(tiny_model, on_a_stream, stream_requests(tokenizer), STEPS)
    for i in range(STREAMS):
        name = f"stream{i}"
        assert together[name] == alone[name][: len(together[name])]
        assert len(together[name]) >= STEPS - 4
    for i, (_, _, generated) in enumerate(SHORT):
        by_itself, _, _ = run(
            tiny_model, on_a_stream, [(0, short_request(tokenizer, i))], generated + 4
        )
        assert together[f"short{i}"] == by_itself[f"short{i}"], f"short{i}"
        assert len(by_itself[f"short{i}"]) == generated

    # Short chats joined vacancies the earlier ones left; the long prompt could not (its
    # join compacted the batch first). The old batch copied twice per short request (12).
    assert counters.joined_in_place >= 3
    assert counters.joined_by_copy >= 1
    assert counters.joined_by_copy + counters.compactions <= 4
    assert any(cached > live for live, cached in shapes)


def test_vacancies_are_compacted_once_they_cost_more_than_the_copy(
    tiny_model: Any, on_a_stream: Any
) -> None:
    _, tokenizer = tiny_model
    together, counters, shapes = run(
        tiny_model,
        on_a_stream,
        stream_requests(tokenizer) + short_requests(tokenizer),
        STEPS,
        copy_seconds_per_cell=FREE_COPIES,
    )
    alone, _, _ = run(tiny_model, on_a_stream, stream_requests(tokenizer), STEPS)
    for i in range(STREAMS):
        assert together[f"stream{i}"] == alone[f"stream{i}"][: len(together[f"stream{i}"])]
    # A vacancy lasts until the next step's compaction at most: never two steps in a row.
    for (live, cached), (next_live, next_cached) in itertools.pairwise(shapes):
        assert not (cached > live and next_cached > next_live and next_live >= live)
    assert counters.compactions >= 3
    assert shapes[-1] == (STREAMS, STREAMS)
