"""A grammar's verdict counts work, not time: the same forced tool call is accepted on an idle
engine and on a loaded one, a format over a limit is refused naming what the request sent
(its tools), and the masks of a step's constrained rows, computed in one llguidance call,
are the masks each row would compute alone."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mlx_redis_protocol.messages import ChatMessage, Job, Tool, ToolChoice
from mlx_redis_worker.daemon.job_prompt import job_prompt
from mlx_redis_worker.engine import EngineCore, SamplingParams, grammar_rows, structured
from mlx_redis_worker.engine.config import GrammarLimits
from tests.engine.test_grammar_limits import FORMAT
from tests.support.engines import PROMPTS, MakeEngine, collect
from tests.support.waiting import run

HEAT = {
    "type": "object",
    "properties": {"room": {"enum": ["kitchen", "hall"]}, "degrees": {"type": "integer"}},
    "required": ["room", "degrees"],
    "additionalProperties": False,
}
# On a loaded machine a timed call takes longer: here every interval the grammar code times
# reads this much longer than it took (1.5x the old 10 ms mask limit, far inside the 250 ms
# safety net), the same for every call, whatever the machine this test runs on.
LOADED_EXTRA_SECONDS = 0.015


class LoadedClock:
    """The ``time`` module as the grammar code sees it on a loaded machine: each
    ``perf_counter`` reading is ``LOADED_EXTRA_SECONDS`` later than the one before it."""

    def __init__(self) -> None:
        self.readings = 0

    def perf_counter(self) -> float:
        self.readings += 1
        return time.perf_counter() + self.readings * LOADED_EXTRA_SECONDS

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def forced_call(tokenizer: Any, name: str) -> tuple[list[int], SamplingParams]:
    """A chat that must call the function ``name``: its prompt and its tools' grammar, as the
    worker builds them for a job."""
    job = Job(
        request_id=f"call-{name}",
        messages=(ChatMessage("user", "Set the kitchen to 21 degrees."),),
        tools=(Tool(name=name, description="Set a room's heating", parameters=HEAT),),
        tool_choice=ToolChoice("function", name),
    )
    prompt = job_prompt(job, tokenizer)
    assert isinstance(prompt.prompt, list) and prompt.response_format is not None
    assert prompt.response_format.subject == "tools"
    params = SamplingParams(max_tokens=12, temperature=0.0, response_format=prompt.response_format)
    return prompt.prompt, params


def test_a_forced_tool_call_gets_the_same_verdict_on_an_idle_and_a_loaded_engine(
    tiny_model: Any, make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle, then with every timed grammar call 15 ms longer and another grammar row in the
    batch: the same kind of forced call (a new function name: compiled again, under load) is
    accepted both times. With limits in microseconds, the loaded one was refused
    (max_mask_us), and passed on retry once the machine was idle."""
    engine = make_engine(tiny_model)
    tokenizer = tiny_model[1]

    async def call(name: str, beside: int) -> tuple[Any, list[Any]]:
        prompt, params = forced_call(tokenizer, name)
        others = [
            await engine.add_request(
                PROMPTS[i], SamplingParams(max_tokens=24, response_format=FORMAT)
            )
            for i in range(beside)
        ]
        final = (await collect(engine, await engine.add_request(prompt, params)))[-1]
        return final, [(await collect(engine, other))[-1] for other in others]

    idle, _ = run(call("set_heat", beside=0))
    clock = LoadedClock()
    for module in (structured, grammar_rows):
        monkeypatch.setattr(module, "time", clock)
    loaded, others = run(call("set_heating", beside=1))
    assert clock.readings > 10  # the grammar code timed its work on the loaded clock

    for final in (idle, loaded, *others):
        assert final.finish_reason in ("stop", "length") and final.error is None, final.error
    stats = engine.scheduler.grammars.stats
    assert stats.over_limit == {} and stats.compiled == 3  # two calls' tools, FORMAT


def test_a_tool_grammar_over_a_limit_is_refused_naming_the_tools(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model, grammar_limits=GrammarLimits(max_grammar_symbols=10))
    prompt, params = forced_call(tiny_model[1], "set_heat")

    async def scenario() -> str:
        with pytest.raises(ValueError) as caught:
            await engine.add_request(prompt, params)
        return str(caught.value)

    message = run(scenario())
    assert message.startswith("tools needs more than max_grammar_symbols (10) allows: ")
    assert "response_format" not in message


def outputs(engine: EngineCore, together: bool) -> list[list[int]]:
    """Greedy constrained outputs of three prompts: in one batch, or one after another."""
    params = SamplingParams(max_tokens=16, temperature=0.0, response_format=FORMAT)

    async def scenario() -> list[list[int]]:
        if together:
            ids = [await engine.add_request(p, params) for p in PROMPTS[:3]]
            finals = [(await collect(engine, rid))[-1] for rid in ids]
        else:
            finals = [
                (await collect(engine, await engine.add_request(p, params)))[-1]
                for p in PROMPTS[:3]
            ]
        return [list(final.output_token_ids) for final in finals]

    return run(scenario())


def test_the_masks_of_a_steps_rows_computed_together_are_each_rows_own(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model)
    stats = engine.scheduler.grammars.stats
    alone = outputs(engine, together=False)
    assert stats.batched_calls == 0
    together = outputs(engine, together=True)
    assert together == alone
    # Every step after the rows' first masks computes all of them in one call.
    assert stats.batched_calls >= 4 and stats.batched_masks >= 2 * stats.batched_calls
