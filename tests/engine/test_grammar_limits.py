"""A response_format's cost stays off the engine thread and inside its limits: the batch keeps
stepping while a grammar compiles, a compiled grammar's matcher is copied per request (never
rebuilt), a format over a limit is refused with a ValueError naming the limit, and the limits
count llguidance's work, so a busy machine does not change a verdict."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import llguidance
import pytest

from mlx_redis_worker.bench.hostile_schemas import deep_anyof, nested_anyof
from mlx_redis_worker.engine import EngineCore, ResponseFormat, SamplingParams
from mlx_redis_worker.engine.config import GRAMMAR_LIMITS, GrammarLimits
from mlx_redis_worker.engine.grammar_rows import SLOW_MASKS_ALLOWED
from tests.support.engines import PROMPTS, MakeEngine, collect
from tests.support.waiting import run, wait_until

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["color", "n"],
    "additionalProperties": False,
}
FORMAT = ResponseFormat("json_schema", schema=SCHEMA)
PLAIN_TOKENS = 24


def constrained(response_format: ResponseFormat = FORMAT) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=0.0, response_format=response_format)


def plain() -> SamplingParams:
    return SamplingParams(max_tokens=PLAIN_TOKENS, temperature=0.0)


def test_the_batch_keeps_stepping_while_a_matcher_is_built(
    tiny_model: Any, make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building a grammar's matcher (seconds for a large schema) is held until an
    unconstrained request has run to its end: it ends only if the engine thread steps while
    the matcher is being built, that is, if the build is not on the engine thread."""
    engine = make_engine(tiny_model, grammar_limits=GrammarLimits(max_grammar_compile_ms=600_000))
    building, release = threading.Event(), threading.Event()
    real = llguidance.LLMatcher

    class HeldMatcher:
        """``LLMatcher`` whose construction waits for ``release``; its static methods as is."""

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            building.set()
            release.wait(120)
            return real(*args, **kwargs)

    for name in dir(real):
        if name.startswith(("grammar_from_", "validate_grammar")):
            setattr(HeldMatcher, name, getattr(real, name))
    monkeypatch.setattr(llguidance, "LLMatcher", HeldMatcher)
    steps: list[list[str]] = []  # the request ids of each engine step's outputs
    engine.set_step_listener(lambda outputs: steps.append([o.request_id for o in outputs]))

    async def scenario() -> tuple[list[Any], list[Any], bool]:
        await engine.start()
        adding = asyncio.create_task(engine.add_request(PROMPTS[0], constrained()))
        await asyncio.to_thread(building.wait, 120)
        plain_id = await engine.add_request(PROMPTS[1], plain())
        plain_outputs = await asyncio.wait_for(collect(engine, plain_id), 90)
        still_building = not adding.done()
        release.set()
        constrained_outputs = await collect(engine, await adding)
        return plain_outputs, constrained_outputs, still_building

    try:
        plain_outputs, constrained_outputs, still_building = run(scenario())
    finally:
        release.set()
    assert still_building
    assert plain_outputs[-1].finish_reason == "length"
    assert len(plain_outputs[-1].output_token_ids) == PLAIN_TOKENS
    # One output per step (stream_interval 1): the engine stepped PLAIN_TOKENS times for it,
    # all before the constrained request was in the batch.
    plain_id = plain_outputs[-1].request_id
    plain_steps = [i for i, ids in enumerate(steps) if plain_id in ids]
    assert len(plain_steps) == PLAIN_TOKENS
    constrained_id = constrained_outputs[-1].request_id
    assert min(i for i, ids in enumerate(steps) if constrained_id in ids) > max(plain_steps)
    final = constrained_outputs[-1]
    assert final.finish_reason == "stop" and final.output_valid is True
    assert json.loads(final.output_text)["color"] in ("red", "green", "blue")


def test_a_compiled_grammar_is_copied_per_request_never_rebuilt(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model)

    async def scenario() -> list[Any]:
        first = await engine.add_request(PROMPTS[0], constrained())
        rest = [await engine.add_request(p, constrained()) for p in PROMPTS[1:4]]
        return [(await collect(engine, rid))[-1] for rid in [first, *rest]]

    finals = run(scenario())
    for final in finals:
        assert final.finish_reason == "stop" and final.output_valid is True
        json.loads(final.output_text)
    stats = engine.scheduler.grammars.stats
    assert (stats.compiled, stats.cache_hits) == (1, 3)
    assert stats.matchers_built == 1  # the expensive build, once, on the compile thread
    assert stats.matcher_copies == 4  # each request's own matcher: a copy


def refused(engine: EngineCore, response_format: ResponseFormat) -> str:
    async def scenario() -> str:
        with pytest.raises(ValueError) as caught:
            await engine.add_request(PROMPTS[0], constrained(response_format))
        return str(caught.value)

    return run(scenario())


def serves_plain(engine: EngineCore) -> None:
    async def scenario() -> Any:
        return (await collect(engine, await engine.add_request(PROMPTS[2], plain())))[-1]

    assert run(scenario()).finish_reason == "length"


def test_a_schema_over_max_schema_bytes_is_refused_before_compiling(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    size = len(json.dumps(SCHEMA, separators=(",", ":")).encode())
    engine = make_engine(tiny_model, grammar_limits=GrammarLimits(max_schema_bytes=size - 1))
    message = refused(engine, FORMAT)
    assert f"response_format is {size} bytes, over max_schema_bytes ({size - 1})" in message
    stats = engine.scheduler.grammars.stats
    assert (stats.over_limit, stats.matchers_built, stats.compiled) == (
        {"max_schema_bytes": 1},
        0,
        0,
    )
    # A pattern counts its own bytes: one as long as the limit passes.
    fits = ResponseFormat("regex", pattern="a" * (size - 1))
    assert engine.scheduler.grammars.compile(fits).key == fits.key()
    serves_plain(engine)


@pytest.mark.parametrize(
    ("limit", "value"), [("max_grammar_symbols", 10), ("max_grammar_lexer_fuel", 10)]
)
def test_a_format_over_a_work_limit_is_refused_naming_it(
    tiny_model: Any, make_engine: MakeEngine, limit: str, value: int
) -> None:
    """Grammar symbols and lexer fuel to build the format: counted by llguidance, over the
    limit refused before the request runs."""
    engine = make_engine(tiny_model, grammar_limits=GrammarLimits(**{limit: value}))
    message = refused(engine, FORMAT)
    assert message.startswith(f"response_format needs more than {limit} ({value}) allows: ")
    stats = engine.scheduler.grammars.stats
    assert stats.over_limit == {limit: 1}
    assert stats.compiled == 0  # nothing refused is cached
    serves_plain(engine)


def test_a_compile_over_max_grammar_compile_ms_is_refused_and_cached_for_later(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """A wide anyOf tree takes far longer than 1 ms to build: the request is refused at the
    limit, the compile ends in the background, and its grammar is cached (its cost is spent)."""
    engine = make_engine(tiny_model, grammar_limits=GrammarLimits(max_grammar_compile_ms=1))
    slow = ResponseFormat("json_schema", schema=deep_anyof("t", width=8, depth=2))
    message = refused(engine, slow)
    assert "response_format took over max_grammar_compile_ms (1 ms) to compile" in message
    stats = engine.scheduler.grammars.stats
    assert stats.over_limit == {"max_grammar_compile_ms": 1}
    serves_plain(engine)
    wait_until(lambda: stats.compiled == 1, 120, "the refused compile to finish and be cached")
    hits = stats.cache_hits
    engine.scheduler.grammars.compile(slow)
    assert (stats.compiled, stats.cache_hits, stats.matchers_built) == (1, hits + 1, 1)


def test_grammar_limits_must_be_positive_integers() -> None:
    for name in GRAMMAR_LIMITS:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=rf"GrammarLimits\.{name}"):
                GrammarLimits(**{name: bad})


def test_a_sequence_whose_masks_turn_slow_is_refused_beside_a_plain_one(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """A format compiled (and cached) under a generous mask limit, then run under a 1 us one:
    its sequence is refused after SLOW_MASKS_ALLOWED slow masks, as the request's fault, with
    the limit named, while the unconstrained request beside it runs to its end."""
    engine = make_engine(tiny_model)
    grammars = engine.scheduler.grammars

    async def scenario() -> tuple[Any, Any]:
        await collect(engine, await engine.add_request(PROMPTS[0], constrained()))
        grammars.limits = GrammarLimits(max_mask_us=1)
        slow = await engine.add_request(PROMPTS[0], constrained())
        plain_id = await engine.add_request(PROMPTS[1], plain())
        return (await collect(engine, slow))[-1], (await collect(engine, plain_id))[-1]

    slow, plain_final = run(scenario())
    assert slow.finish_reason == "error" and slow.request_fault is True
    assert slow.output_valid is False
    assert slow.error is not None
    assert "GrammarLimitError: response_format's token masks took over max_mask_us (1)" in (
        slow.error
    )
    assert f"{SLOW_MASKS_ALLOWED + 1} times" in slow.error
    assert slow.completion_tokens <= SLOW_MASKS_ALLOWED + 1
    assert plain_final.finish_reason == "length" and plain_final.request_fault is False
    assert plain_final.completion_tokens == PLAIN_TOKENS
    stats = grammars.stats
    assert stats.over_limit == {"max_mask_us": 1}
    assert stats.slow_masks == SLOW_MASKS_ALLOWED + 1
    assert (stats.compiled, stats.cache_hits) == (1, 1)


def test_the_nested_anyof_schema_runs_within_the_limits_and_ends_typed_over_them(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    """The isolation bench's nested ``anyOf`` (6 wide, 4 deep, about 110 KiB): accepted under
    the default limits (its masks stay inside them); under a mask budget of a few Earley
    items, its request ends with a GrammarLimitError naming max_mask_items, a fault of the
    request's own, while a plain request beside it runs to its end."""

    def params(salt: str) -> SamplingParams:
        nested = ResponseFormat("json_schema", schema=nested_anyof(salt))
        return SamplingParams(max_tokens=24, temperature=0.0, response_format=nested)

    engine = make_engine(tiny_model)

    async def scenario() -> tuple[Any, Any, Any]:
        accepted = (await collect(engine, await engine.add_request(PROMPTS[0], params("a"))))[-1]
        engine.scheduler.grammars.limits = GrammarLimits(max_mask_items=8)  # a new compile's
        over = await engine.add_request(PROMPTS[0], params("b"))
        plain_id = await engine.add_request(PROMPTS[1], plain())
        return accepted, (await collect(engine, over))[-1], (await collect(engine, plain_id))[-1]

    accepted, over, plain_final = run(scenario())
    assert accepted.finish_reason in ("stop", "length") and accepted.error is None
    assert over.finish_reason == "error" and over.request_fault is True
    assert "GrammarLimitError: response_format needs more than max_mask_items (8)" in over.error
    assert engine.scheduler.grammars.stats.over_limit == {"max_mask_items": 1}
    assert plain_final.finish_reason == "length"
