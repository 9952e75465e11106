"""Anthropic's Messages API without a server: how a body becomes the chat job (and which are
refused, in this API's names), how hand-built protocol events become its event stream (a pure
function of the log, so a resumed stream is exactly the rest), and its error shapes."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from mlx_redis_gateway.anthropic_api import parse_messages_request
from mlx_redis_gateway.anthropic_shaping import MessageFrames, message_object
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.openai_api import CompletionRequest
from mlx_redis_gateway.shaping import ResponseShape, Shaper
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import (
    ChatMessage,
    ContentPart,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    QueuedEvent,
    ResetEvent,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    Usage,
)
from tests.support.media import image_file

ID = "msg_0123456789abcdef"
PNG = image_file(1, (8, 8))
PNG_BLOCK: Any = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()},
}
BAD_IMAGE: Any = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "@@@@"},
}
SCHEMA: Any = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL: Any = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}


def parse(**body: Any) -> CompletionRequest:
    return parse_messages_request(
        {"model": "tiny", "max_tokens": 8, **body}, limits=DEFAULT_LIMITS, user_key="team-a"
    )


def refusal(**body: Any) -> str:
    with pytest.raises(ApiError) as caught:
        parse(**body)
    assert caught.value.status == 400
    return caught.value.message


def test_a_conversation_with_tool_use_and_results_is_the_chat_of_the_same_turns() -> None:
    """``system`` blocks a system turn; an assistant's text and ``tool_use`` one turn with its
    calls; a user's ``tool_result``s a ``tool`` turn each, in order, its text a user turn
    after them; the choice, parallelism, sampling and stop fields the job's."""
    accepted = parse(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"},
                    {"type": "tool_result", "tool_use_id": "call_2", "is_error": True},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        temperature=0.5,
        top_k=20,
        stop_sequences=["END"],
        metadata={"user_id": "ada"},
    )
    job = accepted.job
    assert accepted.kind == "messages" and job.request_id.startswith("msg_")
    assert job.messages == (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage(
            "assistant", "Checking.", tool_calls=(ToolCall("call_1", "get_weather", "{}"),)
        ),
        ChatMessage("tool", "18 C", tool_call_id="call_1"),
        ChatMessage("tool", "", tool_call_id="call_2"),
        ChatMessage("user", "Thanks."),
    )
    assert job.tool_choice == ToolChoice("required") and job.parallel_tool_calls is False
    assert job.tools is not None and job.tools[0].parameters == SCHEMA
    assert (job.temperature, job.top_k, job.stop, job.tenant) == (0.5, 20, ("END",), "team-a")
    assert job.metadata == {"user": "ada", "api_key": "team-a"}
    assert job.count_only is None and job.max_tokens == 8
    named = parse(
        messages=[{"role": "user", "content": "x"}],
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert named.job.tool_choice == ToolChoice("function", "get_weather")
    assert named.job.parallel_tool_calls is None
    seen = parse(
        messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, PNG_BLOCK]}]
    )
    assert seen.job.images is not None and seen.job.images[0].data == PNG
    assert seen.job.messages is not None
    assert seen.job.messages[0].parts == (ContentPart("text", "What?"), ContentPart("image"))
    counted = parse_messages_request(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        limits=DEFAULT_LIMITS,
        count_only=True,
    )
    assert counted.job.count_only is True and counted.job.max_tokens == 1
    with pytest.raises(ApiError, match="count_tokens cannot count images"):
        parse_messages_request(
            {"model": "tiny", "messages": [{"role": "user", "content": [PNG_BLOCK]}]},
            limits=DEFAULT_LIMITS,
            count_only=True,
        )


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"max_tokens": None}, "max_tokens: Field required"),
        ({"messages": []}, "messages: must be a non-empty array"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.source.type: must be base64 or url",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x"}, BAD_IMAGE]}
                ],
                "system": "Be brief.",
            },
            "messages.0.content.1: ",  # its position in the body, not the chat's
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": [PNG_BLOCK]},
                    {"role": "user", "content": "y"},
                ]
            },
            "messages.1.content.0: images are taken in a user message's content only",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
            "prefilling",
        ),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0: tools of type"),
        ({"tools": [{"name": "has space", "input_schema": SCHEMA}]}, "tools.0.name must be"),
        ({"tools": [TOOL], "tool_choice": {"type": "required"}}, "tool_choice.type"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"temperature": 1.5}, "temperature: must be between 0 and 1"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"mcp_servers": [{"url": "x"}]}, "MCP servers"),
        ({"metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
    ],
)
def test_bodies_anthropic_would_refuse_are_400s_in_its_names(
    body: dict[str, Any], said: str
) -> None:
    assert said in refusal(**{"messages": [{"role": "user", "content": "hi"}], **body})


def test_errors_take_anthropics_shape_and_statuses_on_its_paths() -> None:
    """The same error, OpenAI's shape elsewhere; Anthropic's type per status, 503 as 529."""
    cases = {
        400: (400, "invalid_request_error"),
        401: (401, "authentication_error"),
        403: (403, "permission_error"),
        404: (404, "not_found_error"),
        413: (413, "request_too_large"),
        415: (415, "invalid_request_error"),
        429: (429, "rate_limit_error"),
        500: (500, "api_error"),
        503: (529, "overloaded_error"),
        504: (504, "timeout_error"),
    }
    for status, (answered, kind) in cases.items():
        error = ApiError(status, "no", code="x")
        assert error.status_for("/v1/messages") == answered
        assert error.body_for("/v1/messages/count_tokens") == {
            "type": "error",
            "error": {"type": kind, "message": "no"},
        }
        assert error.status_for("/v1/chat/completions") == status
        assert error.body_for("/v1/messagesx") == error.body()


# -- the event stream ------------------------------------------------------------------------


def _delta(
    seq: int, text: str = "", attempt: int = 1, token: int | None = None, **fields: Any
) -> DeltaEvent:
    """A delta of one token (its seq, unless a re-run repeats an earlier one)."""
    tokens = (seq if token is None else token,)
    return DeltaEvent(
        request_id=ID, seq=seq, attempt=attempt, new_text=text, new_token_ids=tokens, **fields
    )


def _done(seq: int, **fields: Any) -> DoneEvent:
    return DoneEvent(
        request_id=ID,
        seq=seq,
        attempt=1,
        finish_reason="stop",
        usage=Usage(10, 6, cached_tokens=4),
        **{"output_text": "", **fields},
    )


CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
EVENTS: list[Event] = [
    QueuedEvent(request_id=ID, seq=0, attempt=0),
    _delta(1, reasoning="Let me "),
    _delta(2, reasoning="look."),
    _delta(3, "Sure. "),
    _delta(4, tool_calls=(ToolCallDelta(0, id="call_1", name="get_weather"),)),
    _delta(5, tool_calls=(ToolCallDelta(0, arguments='{"city": '),)),
    _delta(6, tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),)),
    _done(7, output_text="Sure. ", reasoning_text="Let me look.", tool_calls=(CALL,)),
]


def _stream(events: list[Event], after: int = -1) -> bytes:
    frames = MessageFrames(ID, ResponseShape("messages", "tiny", 0))
    out = [frames.opening()] if after < 0 else []
    out += [frames.feed(event, after) for event in events]
    return b"".join(out)


def _messages(raw: bytes) -> list[tuple[int | None, dict[str, Any]]]:
    """Each SSE message's id and data (its event name checked against its type)."""
    parsed = []
    for block in raw.decode().split("\r\n\r\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in block.split("\r\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        parsed.append((int(lines["id"]) if "id" in lines else None, data))
    return parsed


def test_a_thought_text_and_call_stream_as_blocks_and_end_as_the_message() -> None:
    """Thought, text, call: a block each, opened when it begins and stopped when the next
    one does; the last message of each event carries its seq; the end says ``tool_use`` and
    the usage (uncached input, cache reads, output); the same blocks as the whole message."""
    messages = _messages(_stream(EVENTS))
    kinds = [(data["type"], data.get("index")) for _, data in messages]
    assert kinds == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    ids = [seq for seq, _ in messages]
    assert ids == [None, 0, None, 1, 2, None, None, 3, None, 4, 5, 6, None, None, 7]
    end = messages[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"] == {
        "input_tokens": 6,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 6,
    }
    blocks = [
        data["content_block"] for _, data in messages if data["type"] == "content_block_start"
    ]
    assert blocks[2] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    shaper = Shaper(ID, ResponseShape("messages", "tiny", 0), streaming=False)
    for event in EVENTS:
        shaper.feed(event)
    whole = message_object(shaper)
    assert [block["type"] for block in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][2]["input"] == {"city": "Paris"}


def test_a_stream_resumed_after_any_id_is_exactly_the_rest() -> None:
    full = _stream(EVENTS)
    for seq in range(len(EVENTS)):
        marker = b"id: %d\r\n" % seq
        if marker not in full:
            continue
        end = full.index(b"\r\n\r\n", full.index(marker)) + 4
        assert _stream(EVENTS, after=seq) == full[end:], seq


def test_a_rerun_that_repeats_streams_on_and_one_that_differs_ends_in_an_error_event() -> None:
    """After a worker crash (``reset``), a re-run's thought and text that repeat what was sent
    add nothing; one that differs ends the stream with an ``error`` event (``api_error``), as
    a job's own error does (``invalid_job``: ``invalid_request_error``)."""
    repeated = [*EVENTS[:4], ResetEvent(request_id=ID, seq=4, attempt=2)]
    again = [
        _delta(5, reasoning="Let me ", attempt=2, token=1),
        _delta(6, reasoning="look.", attempt=2, token=2),
        _delta(7, "Sure. ", attempt=2, token=3),
    ]
    assert _stream([*repeated, *again]) == _stream(EVENTS[:4])
    differing = _messages(_stream([*repeated, _delta(5, "Nope", attempt=2, token=99)]))
    assert differing[-1][1]["type"] == "error"
    assert differing[-1][1]["error"]["type"] == "api_error"
    error = ErrorEvent(request_id=ID, seq=1, attempt=1, code="invalid_job", message="bad")
    assert _messages(_stream([EVENTS[0], error]))[-1][1] == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }
