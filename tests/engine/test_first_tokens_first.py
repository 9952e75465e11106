"""First tokens first: which requests are prefilled next, and when their first tokens leave.

The admission policy is a pure function (property tests); the step sequence is the real
scheduler over the tiny model, counted in steps rather than seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator

from mlx_redis_worker.engine.admission import pick_prefill_group
from mlx_redis_worker.engine.config import SchedulerConfig
from mlx_redis_worker.engine.phased_generator import PhasedBatchGenerator, SplitModel
from mlx_redis_worker.engine.request import Request, SamplingParams
from mlx_redis_worker.engine.scheduler import Scheduler
from tests.support.engines import MakeEngine, reference_tokens

# -- the admission policy ----------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    name: int
    length: int
    arrival: float


def pick(waiting: list[Waiting], size: int, now: float, max_wait: float) -> list[Waiting]:
    return pick_prefill_group(
        waiting, size, now, max_wait, length=lambda w: w.length, arrival=lambda w: w.arrival
    )


LONG_TOKENS = 1024


def pick_in_rooms(
    waiting: list[Waiting],
    size: int,
    now: float,
    max_wait: float,
    long_room: int,
    short_room: int | None = None,
) -> list[Waiting]:
    return pick_prefill_group(
        waiting,
        size,
        now,
        max_wait,
        length=lambda w: w.length,
        arrival=lambda w: w.arrival,
        long_room=long_room,
        long_tokens=LONG_TOKENS,
        short_room=short_room,
    )


queues = st.lists(
    st.tuples(st.integers(1, 4096), st.floats(0.0, 10.0, allow_nan=False)), max_size=40
).map(lambda items: [Waiting(i, length, arrival) for i, (length, arrival) in enumerate(items)])


@settings(max_examples=300, deadline=None)
@given(queues, st.integers(0, 12), st.integers(0, 12), st.floats(0.0, 12.0), st.floats(0.0, 5.0))
def test_long_prompts_take_no_more_than_their_room(
    waiting: list[Waiting], size: int, long_room: int, now: float, max_wait: float
) -> None:
    """At most ``long_room`` prompts over ``long_tokens``; a shorter one is never left out for
    a long one, and the group is full unless only long ones are left."""
    long_tokens = LONG_TOKENS
    group = pick_in_rooms(waiting, size, now, max_wait, long_room)
    longs = [w for w in group if w.length > long_tokens]
    assert len(longs) <= long_room
    assert len({w.name for w in group}) == len(group) <= size
    left = [w for w in waiting if w not in group]
    if len(group) < size:
        assert all(w.length > long_tokens for w in left)
        assert not left or len(longs) == long_room
    shorts = [w for w in waiting if w.length <= long_tokens]
    taken = pick(shorts, size - len(longs), now, max_wait)
    assert [w for w in group if w.length <= long_tokens] == taken


@settings(max_examples=300, deadline=None)
@given(queues, st.integers(0, 12), st.integers(0, 12), st.floats(0.0, 12.0), st.floats(0.0, 5.0))
def test_each_prompt_lane_takes_no_more_than_its_free_rows(
    waiting: list[Waiting], long_room: int, short_room: int, now: float, max_wait: float
) -> None:
    """The two prefill lanes' free rows: at most ``long_room`` prompts over ``long_tokens``
    and ``short_room`` of the others, each kind taken in the order it is taken alone."""
    long_tokens = LONG_TOKENS
    group = pick_in_rooms(waiting, long_room + short_room, now, max_wait, long_room, short_room)
    longs = [w for w in waiting if w.length > long_tokens]
    shorts = [w for w in waiting if w.length <= long_tokens]
    assert [w for w in group if w.length > long_tokens] == pick(longs, long_room, now, max_wait)
    assert [w for w in group if w.length <= long_tokens] == pick(shorts, short_room, now, max_wait)


@settings(max_examples=300, deadline=None)
@given(queues, st.integers(0, 12), st.floats(0.0, 12.0), st.floats(0.0, 5.0))
def test_overdue_requests_go_first_then_the_shortest(
    waiting: list[Waiting], size: int, now: float, max_wait: float
) -> None:
    group = pick(waiting, size, now, max_wait)
    assert len(group) == min(size, len(waiting))
    assert len({w.name for w in group}) == len(group)

    def overdue(w: Waiting) -> bool:
        return now - w.arrival >= max_wait

    chosen = {w.name for w in group}
    left = [w for w in waiting if w.name not in chosen]
    chosen_overdue = [w for w in group if overdue(w)]
    # Overdue requests lead the group, oldest first, and none is passed over for a fresh one.
    assert group[: len(chosen_overdue)] == chosen_overdue
    assert [w.arrival for w in chosen_overdue] == sorted(w.arrival for w in chosen_overdue)
    if group and any(overdue(w) for w in left):
        assert all(overdue(w) for w in group)
        assert max(w.arrival for w in group) <= min(w.arrival for w in left if overdue(w))
    # The fresh ones chosen are the shortest of the fresh ones (ties: the earlier arrival).
    fresh_chosen = group[len(chosen_overdue) :]
    fresh_left = [w for w in left if not overdue(w)]
    if fresh_chosen and fresh_left:
        assert max(w.length for w in fresh_chosen) <= min(w.length for w in fresh_left)
    order = {w.name: i for i, w in enumerate(waiting)}
    assert [(w.length, order[w.name]) for w in fresh_chosen] == sorted(
        (w.length, order[w.name]) for w in fresh_chosen
    )


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones() -> None:
    """Each round (one second apart) two short prompts arrive and two are prefilled: the long
    one waits until it is overdue, then goes first."""
    waiting = [Waiting(0, 4000, arrival=0.0)]
    picked_at = None
    for round_ in range(1, 20):
        now = float(round_)
        waiting += [Waiting(2 * round_ + i, 10, arrival=now - 0.5) for i in range(2)]
        group = pick(waiting, 2, now, max_wait=5.0)
        if any(w.name == 0 for w in group):
            picked_at = now
            break
        waiting = [w for w in waiting if w not in group]
    assert picked_at == 5.0  # the first round at which it had waited max_wait


def test_arrival_order_breaks_ties_between_equal_lengths() -> None:
    waiting = [Waiting(i, 8, arrival=float(i)) for i in range(6)]
    assert [w.name for w in pick(waiting, 3, now=6.0, max_wait=100.0)] == [0, 1, 2]


# -- the step sequence over the real model -----------------------------------------------------


def prompts_of_lengths(tokenizer: Any, lengths: list[int]) -> list[list[int]]:
    vocab = [t for t in range(100, 2000) if t not in set(tokenizer.eos_token_ids)]
    return [[vocab[(7 * i + j) % len(vocab)] for j in range(n)] for i, n in enumerate(lengths)]


def run_scheduler(
    tiny_model: Any, stream: Any, prompts: list[list[int]], max_tokens: int, **config: Any
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Step until done: per request, the step numbers of its token-carrying outputs, and its
    tokens."""
    model, tokenizer = tiny_model
    # No request is overdue however slow a loaded machine steps: the order is by length alone
    # (the age bound is the policy tests' subject).
    config.setdefault("max_prefill_wait", 3600.0)
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(enable_prefix_cache=False, **config))
    scheduler.attach_stream(stream)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(
            Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        )
    steps: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while scheduler.has_requests():
        step += 1
        for output in scheduler.step().outputs:
            if output.new_token_ids:
                steps[output.request_id].extend([step] * len(output.new_token_ids))
                tokens[output.request_id].extend(output.new_token_ids)
        assert step < 500
    scheduler.close()
    return steps, tokens


LENGTHS = [40, 9, 25, 3, 17, 31, 12, 6]  # shortest first: r3 r7 r1 r6 | r4 r2 r5 r0


def test_groups_are_prefilled_shortest_first_and_each_first_token_leaves_with_its_prefill(
    tiny_model: Any, on_a_stream: Any
) -> None:
    prompts = prompts_of_lengths(tiny_model[1], LENGTHS)
    # Whole chunks whatever the timings (the budget's subject is test_stall_free). All eight
    # arrive together: the first group's streams started in this burst, so the next group's
    # prefill runs with no decode step beside it (test_stall_free: bursts).
    steps, _ = run_scheduler(
        tiny_model,
        on_a_stream,
        prompts,
        4,
        max_num_seqs=8,
        prefill_batch_size=4,
        min_prefill_tokens=2048,
        max_prefill_stall=math.inf,
    )
    # Each group's prompts fit one prefill chunk: admitted and prefilled in one step, whose
    # outputs carry the group's first tokens.
    assert {r: s[0] for r, s in steps.items()} == {
        **{r: 1 for r in ("r3", "r7", "r1", "r6")},
        **{r: 2 for r in ("r4", "r2", "r5", "r0")},
    }
    # The first decode step, after the burst's last prefill (step 3), runs both groups' first
    # tokens (handed out already) through the model, so second tokens leave from step 4.
    assert steps["r3"] == [1, 4, 5, 6]
    assert steps["r0"] == [2, 4, 5, 6]


def test_smaller_groups_are_prefilled_one_a_step_beside_the_decode(
    tiny_model: Any, on_a_stream: Any
) -> None:
    prompts = prompts_of_lengths(tiny_model[1], LENGTHS)
    steps, _ = run_scheduler(
        tiny_model,
        on_a_stream,
        prompts,
        4,
        max_num_seqs=8,
        prefill_batch_size=2,
        min_prefill_tokens=2048,
        max_prefill_stall=math.inf,
    )
    firsts = [steps[r][0] for r in ("r3", "r7", "r1", "r6", "r4", "r2", "r5", "r0")]
    assert firsts == [1, 1, 2, 2, 3, 3, 4, 4]
    # No decode step until the burst's last group is prefilled (step 4).
    assert steps["r3"] == [1, 6, 7, 8]


def test_greedy_tokens_are_those_of_mlx_lm_whatever_the_grouping(
    tiny_model: Any, on_a_stream: Any
) -> None:
    prompts = prompts_of_lengths(tiny_model[1], LENGTHS)
    _, tokens = run_scheduler(
        tiny_model, on_a_stream, prompts, 10, max_num_seqs=8, prefill_batch_size=3
    )
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == reference_tokens(tiny_model, prompt, 10), i


def test_the_phased_generator_returns_a_first_token_in_its_prefill_step(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """mlx-lm's own step returns a first token two calls after its prompt was processed."""
    model, tokenizer = tiny_model
    prompts = prompts_of_lengths(tokenizer, [12, 5])
    phased = PhasedBatchGenerator(model, stream=on_a_stream)
    uids = phased.insert(prompts, [3, 3])
    progress = {r.uid: r.progress for r in phased.prefill()}
    assert progress == {uids[0]: (12, 12), uids[1]: (5, 5)}  # the last token included
    first = {r.uid: r.token for r in phased.start_generation()}
    assert first == {
        uid: reference_tokens(tiny_model, p, 1)[0] for uid, p in zip(uids, prompts, strict=True)
    }
    assert not phased.has_prefill_work and phased.num_decoding == 2
    phased.close()

    plain = BatchGenerator(model, stream=on_a_stream)
    plain.insert(prompts, [3, 3])
    calls = 1
    while not plain.next()[1]:
        calls += 1
    assert calls == 3
    plain.close()


def test_a_cache_hit_and_a_cold_prompt_share_a_prefill_group(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """A prompt found whole in the prefix cache has nothing left to prefill; in one group with
    a prompt that has, each still gets mlx-lm's greedy tokens."""
    engine = make_engine(tiny_model, max_num_seqs=4, prefill_batch_size=4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    hot, cold = "the quick brown fox jumps over the lazy dog", "once upon a time there was"
    engine.generate_batch_sync([hot], params)
    outputs = engine.generate_batch_sync([hot, cold], params)
    assert outputs[0].cached_tokens > 0 and outputs[1].cached_tokens == 0
    for prompt, output in zip([hot, cold], outputs, strict=True):
        assert output.output_token_ids == reference_tokens(tiny_model, prompt, 6)


class CountingModel:
    """The tiny model, recording each forward pass it is asked for: ``("whole", shape)`` for a
    pass to logits, ``("body", shape)`` for one to hidden states (a prefill pass that keeps its
    last positions' logits applies the head to those alone)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.passes: list[tuple[str, tuple[int, ...]]] = []
        self.model = _Counted(model.model, "body", self.passes)

    def __call__(self, inputs: mx.array, **kwargs: Any) -> mx.array:
        self.passes.append(("whole", tuple(inputs.shape)))
        return self._model(inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _Counted:
    def __init__(self, module: Any, kind: str, passes: list[tuple[str, tuple[int, ...]]]) -> None:
        self._module, self._kind, self._passes = module, kind, passes

    def __call__(self, inputs: mx.array, **kwargs: Any) -> mx.array:
        self._passes.append((self._kind, tuple(inputs.shape)))
        return self._module(inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class OpaqueModel:
    """The tiny model with its body out of reach, as a model whose logits are more than its
    head applied to its last hidden state would be (e.g. soft-capped)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.passes: list[tuple[str, tuple[int, ...]]] = []

    def __call__(self, inputs: mx.array, **kwargs: Any) -> mx.array:
        self.passes.append(("whole", tuple(inputs.shape)))
        return self._model(inputs, **kwargs)

    @property
    def layers(self) -> Any:
        return self._model.layers

    def make_cache(self) -> Any:
        return self._model.make_cache()


def first_tokens_and_decode(
    phased: PhasedBatchGenerator, counting: Any, uids: list[int], sizes: int
) -> dict[int, list[int]]:
    """Prefill every group, then decode to the end, checking that each decode pass is the
    whole running batch's; the tokens by uid."""
    first: dict[int, int] = {}
    while phased.has_prefill_work:
        phased.prefill()
        first.update({r.uid: r.token for r in phased.start_generation()})
    assert phased.num_decoding == sizes
    tokens: dict[int, list[int]] = {uid: [first[uid]] for uid in uids}
    while phased.num_decoding:
        passes = len(counting.passes)
        for response in phased.decode():
            tokens[response.uid].append(response.token)
        assert counting.passes[passes] == ("whole", (sizes, 1)) or phased.num_decoding < sizes
    return tokens


@pytest.mark.parametrize(
    ("wrap", "first_group", "second_group"),
    [
        (CountingModel, [("body", (2, 12))], [("body", (1, 7))]),
        (
            OpaqueModel,
            [("whole", (2, 11)), ("whole", (2, 1))],
            [("whole", (1, 6)), ("whole", (1, 1))],
        ),
    ],
    ids=["body-and-head", "opaque"],
)
def test_each_prefill_group_costs_one_pass_where_the_model_splits(
    tiny_model: Any,
    on_a_stream: Any,
    wrap: Any,
    first_group: list[tuple[str, tuple[int, ...]]],
    second_group: list[tuple[str, tuple[int, ...]]],
) -> None:
    """mlx-lm runs each prompt's last token in a forward pass of its own, then its first
    token in another before handing it out: two passes per prefill group beyond the prompt.
    Here the prefill pass takes the last token and yields its logits (where the model's body
    and head are reachable; an opaque model keeps mlx-lm's pass for the last token), and the
    first token's pass waits for the next decode step, batched with every running sequence.
    The tokens are mlx-lm's either way."""
    model, tokenizer = tiny_model
    counting = wrap(model)
    prompts = prompts_of_lengths(tokenizer, [12, 12, 7])
    phased = PhasedBatchGenerator(counting, stream=on_a_stream, prefill_batch_size=2)
    counting.passes.clear()  # the check, when made, that the body and head give the logits
    phased.insert(prompts, [4, 4, 4])
    phased.prefill()
    phased.start_generation()
    assert counting.passes == first_group
    phased.prefill()
    phased.start_generation()
    assert counting.passes[len(first_group) :] == second_group
    phased.close()

    phased = PhasedBatchGenerator(counting, stream=on_a_stream, prefill_batch_size=2)
    uids = phased.insert(prompts, [4, 4, 4])
    tokens = first_tokens_and_decode(phased, counting, uids, 3)
    assert tokens == {
        uid: reference_tokens(tiny_model, p, 4) for uid, p in zip(uids, prompts, strict=True)
    }
    phased.close()


def test_a_first_token_that_ends_its_request_finishes_it_as_mlx_lm_does(
    tiny_model: Any, on_a_stream: Any
) -> None:
    """A first token that is a stop token, or the last of max_tokens, is handed out by mlx-lm's
    own step with its finish reason; the rest of the group is unchanged."""
    prompts = prompts_of_lengths(tiny_model[1], [10, 14, 6])
    stop_first = reference_tokens(tiny_model, prompts[1], 1)[0]
    model, tokenizer = tiny_model
    scheduler = Scheduler(
        model, tokenizer, SchedulerConfig(enable_prefix_cache=False, max_prefill_wait=3600.0)
    )
    scheduler.attach_stream(on_a_stream)
    requests = [
        Request("long", prompts[0], SamplingParams(max_tokens=5, temperature=0.0)),
        Request(
            "stop",
            prompts[1],
            SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[stop_first]),
        ),
        Request("one", prompts[2], SamplingParams(max_tokens=1, temperature=0.0)),
    ]
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[Any]] = {r.request_id: [] for r in requests}
    while scheduler.has_requests():
        for output in scheduler.step().outputs:
            outputs[output.request_id].append(output)
    scheduler.close()
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in outputs.items()}
    assert tokens == {
        "long": reference_tokens(tiny_model, prompts[0], 5),
        "stop": [],
        "one": reference_tokens(tiny_model, prompts[2], 1),
    }
    assert {rid: outs[-1].finish_reason for rid, outs in outputs.items()} == {
        "long": "length",
        "stop": "stop",
        "one": "length",
    }


class SoftCappedModel:
    """The tiny model with soft-capped logits (as Gemma 2's): its body and head are reachable,
    but the head applied to the last hidden state is not the model's logits."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.model = model.model

    def __call__(self, inputs: mx.array, **kwargs: Any) -> mx.array:
        return 2.0 * mx.tanh(self._model(inputs, **kwargs) / 2.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_only_a_model_whose_body_and_head_give_its_logits_yields_them_from_prefill(
    tiny_model: Any, on_a_stream: Any
) -> None:
    model, _ = tiny_model
    assert SplitModel.of(model) is not None
    assert SplitModel.of(SoftCappedModel(model)) is None
    assert SplitModel.of(OpaqueModel(model)) is None
