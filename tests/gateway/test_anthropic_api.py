"""Anthropic's Messages API on the gateway, as Anthropic's own Python SDK sees it: a real
gateway in front of a real worker (the tiny random model) and a real redis-server.

A Messages request is the chat job of the same conversation: greedy, it gets the chat
completion's text and prompt tokens; its tool calls come from the same grammars (any input
validates); its stream resumes on another gateway after the id a client names; and every
refusal is in Anthropic's error shape with Anthropic's status."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import jsonschema
import openai
import pytest

from tests.gateway.conftest import Fleet
from tests.gateway.test_auth import add_key, key_name
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.media import image_file
from tests.support.schemas import TOOL_SCHEMAS
from tests.support.sse import RawRequest, SseMessage, anthropic_message

MODEL = "tiny"
SYSTEM = "You are terse."
ASK: Any = [{"role": "user", "content": "Turn the kitchen light on."}]
SCHEMAS = TOOL_SCHEMAS
TOOLS: Any = [
    {"name": name, "description": f"{name} in the house", "input_schema": schema}
    for name, schema in SCHEMAS.items()
]
GREEDY: Any = {"temperature": 0}
SAMPLED: Any = {"temperature": 0.7}
HEADERS = {"anthropic-version": "2023-06-01"}
OK: Any = {"type": "text", "text": "ok"}


@pytest.fixture(scope="module")
def claude(gateway: GatewayProcess) -> Iterator[anthropic.Anthropic]:
    """Anthropic's client of the module's gateway (no retries: a failure shows at once), on
    the httpx2 client this SDK version takes."""
    with anthropic.Anthropic(
        base_url=gateway.url,
        api_key="none",
        max_retries=0,
        http_client=httpx2.Client(timeout=300),
    ) as client:
        yield client


def _content(message: Any) -> list[dict[str, Any]]:
    """A message's blocks as plain data (what a streamed message's parsing adds left out)."""
    return [block.to_dict(exclude_unset=True, exclude_none=True) for block in message.content]


def _tool_uses(message: Any) -> list[tuple[str, dict[str, Any]]]:
    """Each ``tool_use`` block's name and input, each checked against its tool's schema."""
    uses = []
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("call_")
            jsonschema.validate(block.input, SCHEMAS[block.name])
            uses.append((block.name, block.input))
    return uses


@pytest.mark.timeout(600)
def test_a_message_is_the_chat_completion_of_its_conversation_streamed_or_not(
    claude: anthropic.Anthropic, client: openai.OpenAI
) -> None:
    """Greedy, a message (system as blocks, two user turns around an assistant one) has the
    chat completion's text and prompt; its stream, parsed by the SDK, ends as the same
    message, with ``max_tokens`` as its stop reason when it ran to the limit; a stop sequence
    it meets ends it with ``stop_sequence``, naming the one."""
    messages: Any = [
        {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."},
    ]
    system: Any = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    request: Any = {"model": MODEL, "max_tokens": 12, "messages": messages, "system": system}
    whole = claude.messages.create(**request, extra_body=GREEDY)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *messages],
        max_tokens=12,
        temperature=0,
    )
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole._request_id == whole.id
    [text] = whole.content
    assert text.type == "text" and text.text == chat.choices[0].message.content
    assert chat.usage is not None
    usage = whole.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert whole.stop_reason == expected and whole.stop_sequence is None

    with claude.messages.stream(**request, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert _content(streamed) == _content(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == usage.output_tokens
    assert streamed.usage.input_tokens + (streamed.usage.cache_read_input_tokens or 0) == (
        chat.usage.prompt_tokens
    )
    # A stop sequence the greedy answer meets ends it there, and is named as its stop reason.
    answer = text.text
    stop = answer[3:7]
    cut = claude.messages.create(**request, stop_sequences=["never there", stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _content(cut) == [{"type": "text", "text": answer[: answer.index(stop)]}]


@pytest.mark.timeout(600)
def test_a_two_turn_tool_loop_with_any_a_named_tool_and_tool_results(
    claude: anthropic.Anthropic,
) -> None:
    """``any``: the answer is a ``tool_use`` block whose input validates, stop reason
    ``tool_use``; sent back with a ``tool_result`` per call, a named tool with
    ``disable_parallel_tool_use`` is called exactly once, streamed or not (the SDK's message
    built from ``input_json_delta``s holds the call their pieces join to)."""
    first = claude.messages.create(
        model=MODEL,
        max_tokens=96,
        messages=ASK,
        tools=TOOLS,
        # One call: the answer ends with it (the random model repeats calls until its limit).
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={**SAMPLED, "seed": 1},
    )
    assert first.stop_reason == "tool_use" and _tool_uses(first)
    results: Any = [
        {
            "type": "tool_result",
            "tool_use_id": block.id,
            "content": [{"type": "text", "text": "ok"}],
        }
        for block in first.content
        if block.type == "tool_use"
    ]
    history: Any = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [*results, {"type": "text", "text": "Now warm it."}]},
    ]
    named: Any = {
        "model": MODEL,
        "max_tokens": 96,
        "messages": history,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "set_heat", "disable_parallel_tool_use": True},
        "extra_body": {**SAMPLED, "seed": 2},
    }
    second = claude.messages.create(**named)
    assert [name for name, _ in _tool_uses(second)] == ["set_heat"]
    assert second.stop_reason == "tool_use"
    with claude.messages.stream(**named) as stream:
        deltas = [e for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    [(name, arguments)] = _tool_uses(streamed)
    joined = "".join(e.delta.partial_json for e in deltas if e.delta.type == "input_json_delta")
    assert name == "set_heat" and json.loads(joined) == arguments
    plain = claude.messages.create(
        model=MODEL, max_tokens=4, messages=history, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert not _tool_uses(plain) and plain.content[0].type == "text"


def test_count_tokens_is_the_prompt_a_worker_renders(
    claude: anthropic.Anthropic, fleet: Fleet
) -> None:
    """``count_tokens`` answers the worker's own count: what the same request's message says
    its prompt was (its tools rendered in it too); its job ran no model (no token made)."""
    request: Any = {"model": MODEL, "system": SYSTEM, "messages": ASK, "tools": TOOLS}
    raw = claude.messages.with_raw_response.count_tokens(**request)
    counted = raw.parse()
    done = fleet.logged_done(raw.headers["request-id"])
    assert (done.usage.completion_tokens, done.output_text, done.finish_reason) == (0, "", "length")
    assert done.usage.ttft_ms is None and done.usage.prompt_tokens == counted.input_tokens
    message = claude.messages.create(max_tokens=1, **request, extra_body=GREEDY)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    without_tools = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert 0 < without_tools.input_tokens < counted.input_tokens


def _stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> list[SseMessage]:
    with RawRequest(url, "POST", "/v1/messages", body=body, headers=headers) as request:
        assert request.response().status == 200
        assert request.response().getheader("request-id")
        return list(request.messages())


@pytest.mark.timeout(600)
def test_a_raw_stream_has_anthropics_events_and_resumes_after_any_id(
    gateway: GatewayProcess,
) -> None:
    """The events in order (``message_start``, ``ping``, a text block's start, deltas and
    stop, ``message_delta``, ``message_stop``); the last message of each protocol event
    carries its seq as id, and ``GET /v1/requests/{id}/stream`` resumes the stream after any
    of them with exactly the messages that followed it (the stream is made from the log, on
    any gateway: ``test_resume`` drops streams and resumes them on another)."""
    body = {"model": MODEL, "max_tokens": 16, "messages": ASK, "stream": True, **GREEDY}
    messages = _stream(gateway.url, body, HEADERS)
    kinds = [message.event for message in messages]
    deltas = len(kinds) - 6
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(json.loads(m.data)["type"] == m.event for m in messages)
    assert messages[1].id == 0 and messages[-1].id is not None
    request_id = json.loads(messages[0].data)["message"]["id"]
    final = json.loads(messages[-2].data)
    assert final["delta"]["stop_reason"] == "max_tokens" and final["usage"]["output_tokens"] == 16
    ids = [position for position, message in enumerate(messages) if message.id is not None]
    for position in (None, ids[1], ids[len(ids) // 2], ids[-2]):
        path = f"/v1/requests/{request_id}/stream"
        after = {} if position is None else {"Last-Event-ID": str(messages[position].id)}
        with RawRequest(gateway.url, "GET", path, headers=after) as resumed:
            assert resumed.response().status == 200
            again = list(resumed.messages())
        expected = messages if position is None else messages[position + 1 :]
        assert again == expected, position


def test_refusals_are_in_anthropics_shape_with_its_statuses(claude: anthropic.Anthropic) -> None:
    """400 ``invalid_request_error`` for a body Anthropic would refuse, an image for a model
    that takes none, a prefill, server tools, another API version; 404 ``not_found_error``
    for a model no worker serves and a path under ``/v1/messages`` that is none; 405 for a
    method the route does not take."""
    base: Any = {"model": MODEL, "max_tokens": 4, "messages": ASK}
    png = base64.b64encode(image_file(1, (8, 8))).decode()
    image: Any = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": png},
    }
    bad: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": [image]}]}, "does not take images"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Sure"}]}, "prefill"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ]
    for extra, said in bad:
        body = {key: value for key, value in {**base, **extra}.items() if value is not None}
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.post("/v1/messages", body=body, cast_to=object)
        assert caught.value.status_code == 400 and caught.value.type == "invalid_request_error"
        assert said in str(caught.value.api_message), (extra, caught.value.body)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(**base, extra_headers={"anthropic-version": "2023-01-01"})
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(**{**base, "model": "no-such-model"})
    assert missing.value.type == "not_found_error"
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": missing.value.api_message},
    }
    with pytest.raises(anthropic.NotFoundError):
        claude.post("/v1/messages/batches", body=base, cast_to=object)
    with pytest.raises(anthropic.APIStatusError) as method:
        claude.get("/v1/messages", cast_to=object)
    assert method.value.status_code == 405 and method.value.type == "invalid_request_error"


def test_keys_by_either_header_and_limits_in_anthropics_shape(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    """A key is read from ``x-api-key`` (the SDK's ``api_key``) or ``Authorization: Bearer``
    (its ``auth_token``); none or a wrong one is a 401 ``authentication_error``; a key over
    its rate a 429 ``rate_limit_error`` with ``retry-after``; a body over the gateway's limit a
    413 ``request_too_large``."""
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name("claude"), "--requests-per-minute", "2")
    keyed = gateways.start("--api-keys", str(keys), "--max-body-bytes", "4096")
    base: Any = {"model": MODEL, "max_tokens": 1, "messages": ASK}

    def sdk(**auth: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=keyed.url, max_retries=0, **auth)

    with sdk(api_key=secret) as by_key, sdk(api_key=None, auth_token=secret) as by_token:
        assert by_key.messages.create(**base).content
        assert by_token.messages.create(**base).content
        with pytest.raises(anthropic.RateLimitError) as limited:
            by_key.messages.create(**base)
        assert limited.value.type == "rate_limit_error"
        assert int(limited.value.response.headers["retry-after"]) >= 1
    with sdk(api_key="nope") as stranger, pytest.raises(anthropic.AuthenticationError) as no:
        stranger.messages.create(**base)
    assert no.value.type == "authentication_error"
    with RawRequest(keyed.url, "POST", "/v1/messages", body=base, headers=HEADERS) as keyless:
        assert keyless.response().status == 401
        assert keyless.json()["error"]["type"] == "authentication_error"
    with sdk(api_key=secret) as by_key, pytest.raises(anthropic.APIStatusError) as large:
        by_key.messages.create(**{**base, "system": "x" * 5000})
    assert large.value.status_code == 413 and large.value.type == "request_too_large"


@pytest.mark.timeout(600)
def test_an_agent_loop_of_six_turns_in_raw_http(gateway: GatewayProcess) -> None:
    """An agent without the SDK: five turns of one forced call each (``any``, no parallel
    calls; streamed and not in turn), each call's ``tool_result`` sent back with the whole
    history as the SDKs send it (a text block beside the results), then a sixth turn with
    ``tool_choice: none`` that answers in text. Every input validates, and each turn's prompt
    is longer than the one before (the results are in it)."""
    history: list[Any] = list(ASK)
    prompts = []
    base: Any = {"model": MODEL, "max_tokens": 96, "tools": TOOLS, **SAMPLED}
    for turn in range(5):
        choice = {"type": "any", "disable_parallel_tool_use": True}
        body = {**base, "messages": history, "tool_choice": choice, "stream": turn % 2 == 1}
        message = anthropic_message(gateway.url, {**body, "seed": turn})
        assert message["id"].startswith("msg_") and message["stop_reason"] == "tool_use", message
        [call] = [block for block in message["content"] if block["type"] == "tool_use"]
        jsonschema.validate(call["input"], SCHEMAS[call["name"]])
        usage = message["usage"]
        prompts.append(usage["input_tokens"] + usage["cache_read_input_tokens"])
        result = {"type": "tool_result", "tool_use_id": call["id"], "content": f"done {turn}"}
        history += [
            {"role": "assistant", "content": message["content"]},
            {"role": "user", "content": [result, {"type": "text", "text": "And next?"}]},
        ]
    assert prompts == sorted(set(prompts)), prompts
    final = anthropic_message(
        gateway.url, {**base, "max_tokens": 8, "messages": history, "tool_choice": {"type": "none"}}
    )
    assert final["stop_reason"] in ("end_turn", "max_tokens")
    assert [block["type"] for block in final["content"]] == ["text"]
