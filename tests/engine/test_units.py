"""Small pieces of the engine in isolation: collectors, stream state, params, text streams."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_redis_worker.engine import (
    EngineConfig,
    RequestOutput,
    RequestOutputCollector,
    RequestStreamState,
    SamplingParams,
    SchedulerConfig,
)
from mlx_redis_worker.engine.text_stream import (
    CachedBPEDetokenizer,
    TextStream,
    stream_detokenizer,
)
from tests.support.engines import detokenized


def _delta(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", new_text=text, new_token_ids=ids, finished=finished)


def test_collector_merges_what_the_reader_has_not_taken() -> None:
    collector = RequestOutputCollector(aggregate=True)
    collector.put(_delta("a", [1]))
    collector.put(_delta("b", [2]))
    collector.put(_delta("c", [3], finished=True))
    merged = collector.get_nowait()
    assert merged is not None
    assert (merged.new_text, merged.new_token_ids, merged.finished) == ("abc", [1, 2, 3], True)
    assert collector.get_nowait() is None


def test_collector_without_aggregation_queues_in_order() -> None:
    collector = RequestOutputCollector(aggregate=False)
    for i in range(3):
        collector.put(_delta(str(i), [i]))
    assert [collector.get_nowait().new_text for _ in range(3)] == ["0", "1", "2"]  # type: ignore[union-attr]


def test_collector_get_waits_for_put() -> None:
    async def scenario() -> str:
        collector = RequestOutputCollector()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, collector.put, _delta("late", [9]))
        return (await collector.get()).new_text

    assert asyncio.run(scenario()) == "late"


def test_stream_state_sends_every_interval_and_always_the_end() -> None:
    state = RequestStreamState(stream_interval=3)
    sent = []
    for n in range(1, 9):
        if state.should_send(n, finished=n == 8):
            state.mark_sent(n, 0)
            sent.append(n)
    assert sent == [3, 6, 8]


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", float("inf")),
        ("seed", -3),
        ("stop", [""]),
        ("stop", "END"),
        ("stop_token_ids", [-1]),
        ("logprobs", 21),
        ("logits_processors", ["not callable"]),
    ],
)
def test_sampling_params_reject_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_configs_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_prefill_wait"):
        SchedulerConfig(max_prefill_wait=float("nan"))
    for seconds in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="max_prefill_pass"):
            SchedulerConfig(max_prefill_pass=seconds)
    for stall in (float("nan"), -0.5):
        with pytest.raises(ValueError, match="max_prefill_stall"):
            SchedulerConfig(max_prefill_stall=stall)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        SchedulerConfig(min_prefill_tokens=0)
    assert SchedulerConfig(max_prefill_stall=float("inf")).max_prefill_stall == float("inf")
    defaults = EngineConfig()
    assert (defaults.model_name, defaults.scheduler_config) == ("", None)
    assert (defaults.step_interval, defaults.stream_interval) == (0.001, 1)
    assert defaults.gpu_memory_utilization == 0.9


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    picks=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=4100).map(lambda i: ("id", i)),
            st.integers(min_value=0, max_value=255).map(lambda i: ("byte", i)),
            st.just(("space", 0)),
        ),
        max_size=40,
    )
)
def test_cached_detokenizer_gives_mlx_lm_text_token_for_token(
    tiny_model: Any, picks: list[tuple[str, int]]
) -> None:
    """The engine's byte-level BPE detokenizer (bytes looked up per token) emits exactly the
    segments mlx-lm's does after every token, and the same text at the end: any ids of the
    vocabulary, the one-byte tokens often (a character's bytes split across tokens), the lone
    space (held back for the next token), and ids past the token map (4096 here)."""
    _, tokenizer = tiny_model
    one_byte = [i for i, text in enumerate(tokenizer.detokenizer.tokenmap) if len(text) == 1]
    assert len(one_byte) >= 256
    space = tokenizer.detokenizer.tokenmap.index("\u0120")  # GPT-2's byte for " "
    pick = {"id": lambda i: i, "byte": one_byte.__getitem__, "space": lambda _: space}
    tokens = [pick[kind](value) for kind, value in picks]
    table: dict[int, Any] = {}
    for _ in range(2):  # the second time from the table the first filled
        ours, theirs = stream_detokenizer(tokenizer, table), tokenizer.detokenizer
        assert isinstance(ours, CachedBPEDetokenizer)
        for token in tokens:
            ours.add_token(token)
            theirs.add_token(token)
            assert ours.last_segment == theirs.last_segment
        ours.finalize()
        theirs.finalize()
        assert (ours.last_segment, ours.text) == (theirs.last_segment, theirs.text)
        assert ours.tokens == theirs.tokens == tokens


WORDS = st.sampled_from(
    ["the", " cat", " sat", "on", " mat", "END", "E", "ND", "!", " ", "é", "\n"]
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    pieces=st.lists(WORDS, min_size=1, max_size=12),
    stops=st.lists(st.sampled_from(["END", "t s", "at\n", "é!", "mat"]), min_size=1, max_size=2),
)
def test_text_stream_cuts_at_the_first_stop_string(
    tiny_model: Any, pieces: list[str], stops: list[str]
) -> None:
    """Whatever the tokenization, the emitted text is the text before the first stop string,
    and that string is the one named as having stopped it."""
    _, tokenizer = tiny_model
    text = "".join(pieces)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    full = detokenized(tokenizer, tokens)
    stream = TextStream(tokenizer.detokenizer, stops)
    emitted = ""
    for token in tokens:
        emitted += stream.add_token(token)
        if stream.stopped:
            break
    emitted += stream.finish()
    cuts = [full.index(s) for s in stops if s in full]
    expected = full[: min(cuts)] if cuts else full
    assert emitted == expected
    assert stream.stopped == bool(cuts)
    # The stop string that ended it is named: one of the request's, right where the text ends.
    if cuts:
        assert stream.stop_string in stops
        assert full[len(emitted) :].startswith(stream.stop_string)
    else:
        assert stream.stop_string is None
