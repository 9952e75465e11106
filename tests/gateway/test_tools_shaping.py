"""Tool calls and reasoning in the gateway's answers, from the events alone: OpenAI's
``delta.tool_calls`` and ``delta.reasoning_content`` chunks, ``message.tool_calls`` with
``finish_reason: "tool_calls"``, and a re-run after a reset that sends nothing twice."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from mlx_redis_gateway.responses_api import ResponseEvents
from mlx_redis_gateway.shaping import ResponseShape, Shaper
from mlx_redis_protocol.messages import (
    DeltaEvent,
    DoneEvent,
    Event,
    ResetEvent,
    ToolCall,
    ToolCallDelta,
    Usage,
)

SHAPE = ResponseShape(kind="chat", model="tiny", created=1)
CALL = ToolCall("call_1", "set_heat", '{"level": 3}')


def _events(attempt: int, first_seq: int) -> list[Event]:
    common: Any = {"request_id": "r", "attempt": attempt}
    return [
        DeltaEvent(seq=first_seq, new_text="", new_token_ids=(1,), reasoning="Hm.", **common),
        DeltaEvent(
            seq=first_seq + 1,
            new_text="",
            new_token_ids=(2,),
            tool_calls=(
                ToolCallDelta(0, id=CALL.id, name=CALL.name),
                ToolCallDelta(0, arguments='{"lev'),
            ),
            **common,
        ),
        DeltaEvent(
            seq=first_seq + 2,
            new_text="",
            new_token_ids=(3,),
            tool_calls=(ToolCallDelta(0, arguments='el": 3}'),),
            **common,
        ),
    ]


def _done(seq: int, attempt: int = 1) -> DoneEvent:
    return DoneEvent(
        request_id="r",
        seq=seq,
        attempt=attempt,
        finish_reason="stop",
        output_text="",
        usage=Usage(5, 3),
        reasoning_text="Hm.",
        tool_calls=(CALL,),
    )


def _deltas(chunks: list[Any]) -> list[dict[str, Any]]:
    return [chunk.data["choices"][0]["delta"] for chunk in chunks if chunk.data.get("choices")]


def test_streamed_calls_and_thought_take_openai_shapes() -> None:
    shaper = Shaper("r", SHAPE)
    chunks = [chunk for event in _events(1, 1) for chunk in shaper.feed(event)]
    closing = shaper.feed(_done(4))
    assert _deltas(chunks) == [
        {"reasoning_content": "Hm."},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "set_heat", "arguments": '{"lev'},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": 'el": 3}'}}]},
    ]
    assert closing[0].data["choices"][0]["finish_reason"] == "tool_calls"
    message = shaper.completion()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "set_heat", "arguments": '{"level": 3}'},
            }
        ],
        "reasoning_content": "Hm.",
        "refusal": None,
    }


def test_a_rerun_sends_only_what_is_new() -> None:
    """Attempt 1 streamed the thought and the call's first fragment; its re-run repeats them
    (a seeded job does): only the rest of the arguments goes out."""
    shaper = Shaper("r", SHAPE)
    first = _events(1, 1)
    sent = [chunk for event in first[:2] for chunk in shaper.feed(event)]
    assert len(_deltas(sent)) == 2
    shaper.feed(ResetEvent(request_id="r", seq=3, attempt=2))
    again = [chunk for event in _events(2, 4) for chunk in shaper.feed(event)]
    assert _deltas(again) == [{"tool_calls": [{"index": 0, "function": {"arguments": 'el": 3}'}}]}]


def test_a_responses_stream_closes_its_text_item_before_a_call_item_opens() -> None:
    """Text, then a call: the ``message`` item (output 0) is done before the
    ``function_call`` item (output 1) is added; the call's argument deltas join to the
    arguments its ``.done`` and the final response carry."""
    common: Any = {"request_id": "resp_r", "attempt": 1}
    calls = _events(1, 2)[1:]
    events = [
        DeltaEvent(seq=1, new_text="Sure.", new_token_ids=(1,), **common),
        *[replace(event, request_id="resp_r") for event in calls],
        replace(_done(4), request_id="resp_r", output_text="Sure.", reasoning_text=""),
    ]
    stream = ResponseEvents("resp_r", Shaper("resp_r", SHAPE), {}, 1.0)
    raw = stream.opening() + b"".join(stream.feed(event) for event in events)
    sent = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert [(m["type"], m.get("output_index")) for m in sent] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    assert [m["sequence_number"] for m in sent] == list(range(len(sent)))
    assert (
        sent[8]["item"] | {"arguments": CALL.arguments, "status": "completed"} == sent[12]["item"]
    )
    joined = "".join(m["delta"] for m in sent if m["type"].endswith("arguments.delta"))
    assert joined == sent[11]["arguments"] == CALL.arguments
    message, call = sent[-1]["response"]["output"]
    assert message["content"][0]["text"] == "Sure." and message["id"] == sent[2]["item"]["id"]
    assert call == sent[12]["item"] and call["call_id"] == CALL.id and call["name"] == CALL.name
