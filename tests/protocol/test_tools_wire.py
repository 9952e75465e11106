"""Tools on the wire: a job's tools, tool choice and chat turns with tool calls, and the
calls and reasoning events carry; round trips, and the decoder's refusals, each with its code
and the field it names."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from mlx_redis_protocol.client import build_job
from mlx_redis_protocol.codec_events import decode_event, encode_event
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.constants import PROTOCOL_VERSION
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.messages import (
    ChatMessage,
    DeltaEvent,
    DoneEvent,
    Job,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    Usage,
)

WEATHER = Tool(
    name="get_weather",
    description="Weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    strict=True,
)
HISTORY = (
    ChatMessage("user", "Weather in Paris?"),
    ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),)),
    ChatMessage("tool", "18 C", tool_call_id="c1", name="get_weather"),
)


@pytest.mark.parametrize(
    "choice",
    [
        None,
        ToolChoice("auto"),
        ToolChoice("none"),
        ToolChoice("required"),
        ToolChoice("function", "get_weather"),
    ],
)
def test_a_job_with_tools_round_trips(choice: ToolChoice | None) -> None:
    job = Job(
        request_id="r1",
        messages=HISTORY,
        tools=(WEATHER, Tool(name="noop")),
        tool_choice=choice,
        parallel_tool_calls=False,
        thinking=False,
    )
    assert decode_job(encode_job(job)) == job


def test_chat_turns_take_the_shape_templates_render() -> None:
    job = Job(request_id="r1", messages=HISTORY)
    assert job.chat_messages() == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "c1", "name": "get_weather"},
    ]


def _raw_job(**fields: Any) -> bytes:
    return msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "request_id": "r1",
            "messages": [{"role": "user", "content": "hi"}],
            **fields,
        }
    )


def test_an_assistant_turn_that_only_calls_may_leave_its_content_out() -> None:
    calls = [{"id": "c1", "name": "f", "arguments": "{}"}]
    job = decode_job(_raw_job(messages=[{"role": "assistant", "tool_calls": calls}]))
    assert job.messages == (ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "f", "{}"),)),)


@pytest.mark.parametrize(
    ("fields", "code", "needle"),
    [
        ({"tools": [{"name": "bad name!"}]}, "invalid_field", "tools[0].name"),
        ({"tools": [{"name": "f"}, {"name": "f"}]}, "invalid_field", "names a function twice"),
        ({"tools": [{"name": "f", "parameters": {"type": "array"}}]}, "invalid_field", "object"),
        ({"tools": [{"name": "f", "parameters": "x"}]}, "invalid_field", "parameters"),
        ({"tools": []}, "invalid_field", "job.tools"),
        ({"tools": [{"name": "f"}] * 129}, "limit_exceeded", "job.tools"),
        ({"tool_choice": "required"}, "invalid_field", "needs tools"),
        ({"tools": [{"name": "f"}], "tool_choice": "sometimes"}, "invalid_field", "tool_choice"),
        ({"tools": [{"name": "f"}], "tool_choice": {"name": "g"}}, "invalid_field", "names no"),
        ({"tools": [{"name": "f"}], "tool_choice": 3}, "invalid_field", "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "invalid_field", "parallel_tool_calls"),
        ({"thinking": 1}, "invalid_field", "thinking"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "name": "f"}]}]},
            "missing_field",
            "arguments",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "name": "f", "arguments": "[1]"}],
                    }
                ]
            },
            "invalid_field",
            "JSON text of an object",
        ),
        ({"messages": [{"role": "assistant"}]}, "missing_field", "content"),
    ],
)
def test_the_decoder_refuses_bad_tool_fields(
    fields: dict[str, Any], code: str, needle: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_job(_raw_job(**fields))
    assert caught.value.code == code
    assert needle in caught.value.message
    assert caught.value.request_id == "r1"


def test_events_carry_reasoning_and_call_pieces_and_whole_calls() -> None:
    delta = DeltaEvent(
        request_id="r1",
        seq=1,
        attempt=1,
        new_text="",
        new_token_ids=(1, 2),
        reasoning="hmm",
        tool_calls=(
            ToolCallDelta(0, id="c1", name="f"),
            ToolCallDelta(0, arguments='{"a": '),
        ),
    )
    done = DoneEvent(
        request_id="r1",
        seq=2,
        attempt=1,
        finish_reason="stop",
        output_text="",
        usage=Usage(3, 2),
        reasoning_text="hmm",
        tool_calls=(ToolCall("c1", "f", '{"a": 1}'),),
    )
    assert decode_event(encode_event(delta)) == delta
    assert decode_event(encode_event(done)) == done
    plain = DeltaEvent(request_id="r1", seq=1, attempt=1, new_text="x", new_token_ids=(1,))
    fields = msgpack.unpackb(encode_event(plain))
    assert "reasoning" not in fields and "tool_calls" not in fields  # as before tools


@pytest.mark.parametrize(
    "piece",
    [{"index": -1}, {"index": "0"}, {"index": 0, "name": "no spaces"}, "x"],
)
def test_a_bad_call_piece_in_an_event_is_refused(piece: Any) -> None:
    raw = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "type": "delta",
            "request_id": "r1",
            "seq": 1,
            "attempt": 1,
            "new_text": "",
            "new_token_ids": [],
            "tool_calls": [piece],
        }
    )
    with pytest.raises(ProtocolError):
        decode_event(raw)


def test_the_client_builds_tool_jobs_from_plain_values() -> None:
    """``submit``'s options as a producer writes them: a choice's name or ``{"name": …}``,
    turns as OpenAI-style maps with their calls."""
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "c1", "name": "get_weather"},
    ]
    for given, choice in (
        ("required", ToolChoice("required")),
        ({"name": "get_weather"}, ToolChoice("function", "get_weather")),
    ):
        job = build_job(
            prompt=None,
            prompt_token_ids=None,
            messages=history,
            request_id="r1",
            options={"tools": [WEATHER], "tool_choice": given},
        )
        assert job.tool_choice == choice
        assert job.messages == HISTORY
    with pytest.raises(ProtocolError, match="tool_choice"):
        build_job(
            prompt="hi",
            prompt_token_ids=None,
            messages=None,
            request_id="r1",
            options={"tools": [WEATHER], "tool_choice": "maybe"},
        )
