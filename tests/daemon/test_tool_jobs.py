"""Jobs with tools and reasoning through a real worker and a real Redis: calls that always
validate against their function's schema (``required``, a named function, ``auto``), the
pieces of a call that join to its arguments, histories with tool turns, a reasoning model's
thought apart from its answer, and the jobs a worker refuses up front.

The tiny model's template knows no tools (the fallback prompt); ``tiny-qwen3-style`` is the
same model under a template of the Qwen3 kind (tools rendered natively, ``<think>``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import (
    ChatMessage,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    Job,
    Tool,
    ToolCall,
    ToolChoice,
)
from tests.daemon.helpers import check_stream, collect, settled
from tests.support.processes import WorkerFactory
from tests.support.tool_models import with_template
from tests.support.waiting import run, until

# Enums and small integers: even the random tiny model ends a constrained call in a few
# dozen tokens.
TOOLS = (
    Tool(
        name="set_light",
        description="Switch a light",
        parameters={
            "type": "object",
            "properties": {
                "room": {"enum": ["kitchen", "hall"]},
                "on": {"type": "boolean"},
            },
            "required": ["room", "on"],
            "additionalProperties": False,
        },
    ),
    Tool(
        name="set_heat",
        parameters={
            "type": "object",
            "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 5}},
            "required": ["level"],
            "additionalProperties": False,
        },
        strict=True,
    ),
)
SCHEMAS = {tool.name: tool.parameters for tool in TOOLS}
ASK = (ChatMessage("user", "Turn the kitchen light on."),)
HISTORY = (
    *ASK,
    ChatMessage(
        "assistant",
        "",
        tool_calls=(ToolCall("call_1", "set_light", '{"room": "kitchen", "on": true}'),),
    ),
    ChatMessage("tool", '{"ok": true}', tool_call_id="call_1"),
)


def _job(request_id: str, **fields: Any) -> Job:
    fields.setdefault("messages", ASK)
    fields.setdefault("max_tokens", 96)
    return Job(request_id=request_id, tools=fields.pop("tools", TOOLS), **fields)


def _joined_calls(events: Sequence[Event]) -> dict[int, dict[str, str]]:
    """The calls the deltas' pieces make, by index: id and name once, arguments joined."""
    calls: dict[int, dict[str, str]] = {}
    for event in events:
        if isinstance(event, DeltaEvent):
            for piece in event.tool_calls:
                call = calls.setdefault(piece.index, {"arguments": ""})
                if piece.id is not None:
                    assert "id" not in call, "a call's id comes once"
                    call["id"], call["name"] = piece.id, piece.name or ""
                call["arguments"] += piece.arguments
    return calls


def _valid_calls(done: DoneEvent, events: Sequence[Event]) -> list[ToolCall]:
    """Every call of ``done`` validates against its function's schema, and the streamed
    pieces made exactly these calls; where ``max_tokens`` ended the output, one more call
    may have been cut short (streamed in part, not in ``done``: protocol/README.md)."""
    for call in done.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    joined = [call for _, call in sorted(_joined_calls(events).items())]
    complete = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in done.tool_calls]
    if done.finish_reason == "length" and len(joined) == len(complete) + 1:
        joined.pop()
    assert joined == complete
    return list(done.tool_calls)


async def _run_jobs(client: Client, jobs: Sequence[Job]) -> dict[str, tuple[Event, list[Event]]]:
    for job in jobs:
        await client.submit_job(job)
    # A long timeout: the fallback prompt is some 450 tokens, prefilled on a shared machine.
    streams = await asyncio.gather(*(collect(client, job.request_id, timeout=240) for job in jobs))
    ends = {}
    for job, events in zip(jobs, streams, strict=True):
        ends[job.request_id] = (check_stream(events, job.request_id).terminal, events)
    return ends


@pytest.mark.timeout(400)
def test_calls_always_validate_in_the_fallback_syntax(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """The tiny model (no tools in its template) sampled at 0.7: ``required`` makes one or
    more valid calls, a named choice calls that function, ``parallel_tool_calls`` false
    makes exactly one, ``auto`` makes only valid ones; a history with tool turns runs."""
    workers.start("w1", max_concurrency=8)
    sampled: Any = {"temperature": 0.7}
    jobs = [
        _job("required", tool_choice=ToolChoice("required"), seed=0, **sampled),
        _job("named", tool_choice=ToolChoice("function", "set_heat"), seed=1, **sampled),
        _job(
            "single",
            tool_choice=ToolChoice("required"),
            parallel_tool_calls=False,
            seed=2,
            **sampled,
        ),
        _job("auto", seed=0, **sampled),
        _job("history", messages=HISTORY, tool_choice=ToolChoice("required"), seed=4, **sampled),
        _job("none", tool_choice=ToolChoice("none"), max_tokens=8),
    ]

    async def main() -> dict[str, tuple[Event, list[Event]]]:
        async with Client(redis_url, prefix=prefix) as client:
            ends = await _run_jobs(client, jobs)
            await until(lambda: settled(client), 10, "entries acknowledged and deleted")
            return ends

    ends = run(main())
    for request_id, (done, events) in ends.items():
        assert isinstance(done, DoneEvent), (request_id, done)
        calls = _valid_calls(done, events)
        if request_id.startswith(("required", "named", "single", "history")):
            assert done.finish_reason == "stop" and calls, (request_id, done)
            assert done.output_text == "" and done.output_valid is True
        if request_id == "named":
            assert {call.name for call in calls} == {"set_heat"}
        if request_id == "single":
            assert len(calls) == 1
        if request_id == "none":
            assert not calls and done.output_valid is None
    ids = [call.id for done, _ in ends.values() for call in done.tool_calls]  # type: ignore[union-attr]
    assert len(set(ids)) == len(ids), "call ids are unique"


@pytest.mark.timeout(400)
def test_a_reasoning_model_streams_its_thought_apart_and_can_skip_it(
    workers: WorkerFactory, redis_url: str, prefix: str, tmp_path: Path, tiny_model_path: Path
) -> None:
    """Under a template that opens ``<think>``, the output is reasoning (here all of it: the
    random model never closes its thought in 12 tokens), ``thinking`` false leaves none; a
    call made after no thought is read from the native hermes syntax the template asked for."""
    folder = with_template(tiny_model_path, tmp_path / "tiny-qwen3-style")
    workers.start("w1", model=f"tiny={folder}", max_concurrency=4)
    plain: Any = {"messages": ASK, "max_tokens": 12, "temperature": 0.0}
    jobs = [
        Job(request_id="thinks", **plain),
        Job(request_id="no-thought", thinking=False, **plain),
        _job("calls", tool_choice=ToolChoice("required"), thinking=False, temperature=0.0),
        _job(
            "history",
            messages=HISTORY,
            tool_choice=ToolChoice("required"),
            thinking=False,
            temperature=0.0,
        ),
    ]

    async def main() -> dict[str, tuple[Event, list[Event]]]:
        async with Client(redis_url, prefix=prefix) as client:
            return await _run_jobs(client, jobs)

    ends = run(main())
    thinks, thinks_events = ends["thinks"]
    assert isinstance(thinks, DoneEvent) and thinks.finish_reason == "length"
    assert thinks.reasoning_text and thinks.output_text == ""
    streamed = "".join(e.reasoning for e in thinks_events if isinstance(e, DeltaEvent))
    assert streamed == thinks.reasoning_text
    plain_done, _ = ends["no-thought"]
    assert isinstance(plain_done, DoneEvent)
    assert plain_done.reasoning_text == "" and plain_done.output_text
    for name in ("calls", "history"):
        done, events = ends[name]
        assert isinstance(done, DoneEvent) and done.finish_reason == "stop", done
        assert _valid_calls(done, events)


@pytest.mark.timeout(400)
def test_tool_jobs_the_worker_cannot_run_are_invalid_jobs(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    """A function schema llguidance cannot enforce fails closed, as a response_format does;
    tools beside a response_format are refused; the worker serves on."""
    workers.start("w1")
    unenforceable = Tool(
        name="tags",
        parameters={
            "type": "object",
            "properties": {
                "t": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
            },
        },
    )
    jobs = [
        _job("unenforceable", tools=(unenforceable,), tool_choice=ToolChoice("required")),
        _job("with-format", response_format={"type": "json_object"}),
        # One call, so that it ends well inside max_tokens.
        _job("after", tool_choice=ToolChoice("required"), parallel_tool_calls=False),
    ]

    async def main() -> dict[str, tuple[Event, list[Event]]]:
        async with Client(redis_url, prefix=prefix) as client:
            return await _run_jobs(client, jobs)

    ends = run(main())
    for name, needle in (("unenforceable", "uniqueItems"), ("with-format", "response_format")):
        error, events = ends[name]
        assert isinstance(error, ErrorEvent) and error.code == "invalid_job", error
        assert needle in error.message
    done, events = ends["after"]
    assert isinstance(done, DoneEvent) and _valid_calls(done, events)
