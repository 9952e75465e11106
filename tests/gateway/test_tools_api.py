"""Tool calls and reasoning through the gateway, as OpenAI's own client sees them: a real
gateway in front of a real worker (the tiny random model, and the same model under a
Qwen3-style template that thinks) and a real redis-server.

The tiny model's template knows no tools, so it gets the fallback prompt; whatever it
samples, the grammar makes every call parse and validate against its function's schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import instructor
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, SecretStr

from mlx_redis_worker.local_redis import RedisServer
from tests.gateway.conftest import Fleet, running_fleet
from tests.support.gateway import GatewayProcess
from tests.support.schemas import TOOL_SCHEMAS
from tests.support.sse import anthropic_message
from tests.support.tool_models import with_template

MODEL = "tiny"
THINKER = "tiny-think"
SCHEMAS = TOOL_SCHEMAS
TOOLS: Any = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK: Any = [{"role": "user", "content": "Turn the kitchen light on."}]
SAMPLED: Any = {"temperature": 0.7, "max_tokens": 96}


@pytest.fixture(scope="module")
def fleet(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path
) -> Iterator[Fleet]:
    """One worker serving ``tiny`` and ``tiny-think`` (its weights under a template that
    thinks and renders tools natively)."""
    directory = tmp_path_factory.mktemp("tools-fleet")
    thinker = with_template(tiny_model_path, directory / THINKER)
    with running_fleet(redis_server, directory, f"{MODEL},{THINKER}={thinker}") as fleet:
        yield fleet


def _valid(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    """Each call's name and parsed arguments, each checked against its function's schema."""
    checked = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        checked.append((call.function.name, arguments))
    return checked


@pytest.mark.timeout(600)
def test_required_and_named_calls_validate_and_end_with_tool_calls(client: openai.OpenAI) -> None:
    """``required``: calls only, ``finish_reason: "tool_calls"``, content null; a named
    function is the only one called; ``parallel_tool_calls`` false makes exactly one."""
    required = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=1, **SAMPLED
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and _valid(choice.message.tool_calls)
    named = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_heat"}},
        parallel_tool_calls=False,
        seed=2,
        **SAMPLED,
    )
    calls = _valid(named.choices[0].message.tool_calls)
    assert [name for name, _ in calls] == ["set_heat"]


@pytest.mark.timeout(600)
def test_streamed_argument_fragments_join_to_the_calls(client: openai.OpenAI) -> None:
    """The stream's ``delta.tool_calls``: a call's first fragment has its index, id, type
    and name, the next ones argument text; joined per index they are valid arguments, and
    the same request unstreamed makes the same calls (same seed)."""
    request: Any = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,  # one call: the answer ends with it, never cut
    }
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, seed=5, **request, **SAMPLED):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content
        for piece in choice.delta.tool_calls or ():
            if piece.id is not None:
                assert piece.index not in calls and piece.type == "function"
                assert piece.function is not None and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "args": ""}
            assert piece.function is not None
            calls[piece.index]["args"] += piece.function.arguments or ""
    assert finish == "tool_calls" and sorted(calls) == [0]
    for call in calls.values():
        jsonschema.validate(json.loads(call["args"]), SCHEMAS[call["name"]])
    whole = client.chat.completions.create(seed=5, **request, **SAMPLED)
    assert [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls or ()
    ] == [(call["name"], call["args"]) for call in calls.values()]


@pytest.mark.timeout(600)
def test_auto_calls_validate_and_histories_with_tool_turns_are_accepted(
    client: openai.OpenAI,
) -> None:
    """``auto`` at 0.7: any call made validates and the finish reason says whether one was
    made; a chat holding an assistant turn's calls and the tool's answer runs."""
    for seed in range(2):
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, seed=seed, **SAMPLED
        )
        choice = answer.choices[0]
        _valid(choice.message.tool_calls or ())
        expected = "tool_calls" if choice.message.tool_calls else choice.finish_reason
        assert choice.finish_reason == expected
    history: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "set_light",
                        "arguments": '{"room": "kitchen", "on": true}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
    ]
    after = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="required", seed=3, **SAMPLED
    )
    assert _valid(after.choices[0].message.tool_calls)
    plain = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    assert isinstance(plain, ChatCompletion) and plain.choices[0].message.content is not None


def test_tool_requests_the_gateway_refuses(client: openai.OpenAI) -> None:
    """400s naming the parameter: a tool that is no function, a choice naming no tool, a
    tool message without its call's id, tools beside a response_format."""
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ]
    for extra, param in bad:
        body: Any = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**body)
        assert caught.value.param == param, (extra, caught.value.body)


@pytest.mark.timeout(600)
def test_a_thinking_model_answers_with_reasoning_content_apart(client: openai.OpenAI) -> None:
    """``tiny-think`` opens ``<think>``: its output (12 tokens, the thought never closed) is
    ``reasoning_content``, streamed as such too; ``enable_thinking`` false leaves none."""
    request: Any = {"model": THINKER, "messages": ASK, "max_tokens": 12, "temperature": 0.0}
    whole = client.chat.completions.create(**request)
    message: Any = whole.choices[0].message
    assert message.reasoning_content and message.content == ""
    streamed = "".join(
        getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
        for chunk in client.chat.completions.create(stream=True, **request)
    )
    assert streamed == message.reasoning_content
    off = client.chat.completions.create(
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **request
    )
    assert off.choices[0].message.content
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_a_thinking_model_answers_a_message_with_a_thinking_block(
    gateway: GatewayProcess,
) -> None:
    """Anthropic's Messages API: ``tiny-think``'s thought is a ``thinking`` block (streamed as
    ``thinking_delta``s: the same block); ``thinking: disabled`` leaves text and no thought."""
    body: Any = {"model": THINKER, "messages": ASK, "max_tokens": 12, "temperature": 0}
    whole = anthropic_message(gateway.url, {**body, "stream": False})
    [thought] = whole["content"]
    assert thought["type"] == "thinking" and thought["thinking"] and thought["signature"] == ""
    assert anthropic_message(gateway.url, body)["content"] == whole["content"]
    off = anthropic_message(
        gateway.url, {**body, "thinking": {"type": "disabled"}, "stream": False}
    )
    assert [block["type"] for block in off["content"]] == ["text"] and off["content"][0]["text"]


class Light(BaseModel):
    """Switch a light."""

    room: Literal["kitchen", "hall"]
    on: bool


@pytest.mark.timeout(600)
def test_instructor_tools_mode_gets_a_valid_model(gateway: GatewayProcess) -> None:
    """instructor's default ``Mode.TOOLS`` (a named function from a pydantic model) parses
    the gateway's call into the model on its first try."""
    with openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0) as raw:
        client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
        light = client.chat.completions.create(
            model=MODEL, messages=ASK, response_model=Light, max_retries=0, **SAMPLED
        )
    assert isinstance(light, Light)


@pytest.mark.timeout(600)
def test_langchain_bind_tools_and_structured_output(gateway: GatewayProcess) -> None:
    """langchain-openai's ``bind_tools`` answers with ``tool_calls`` whose args validate, and
    ``with_structured_output(method="function_calling")`` returns the model."""
    chat = ChatOpenAI(
        base_url=gateway.base_url, api_key=SecretStr("none"), model=MODEL, max_retries=0, **SAMPLED
    )
    message = chat.bind_tools(TOOLS, tool_choice="required").invoke("Turn the kitchen light on.")
    assert message.tool_calls
    for call in message.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
    structured = chat.with_structured_output(Light, method="function_calling", include_raw=True)
    answer = structured.invoke("Turn the kitchen light on.")
    assert isinstance(answer, dict)
    assert isinstance(answer["parsed"], Light), answer["raw"].response_metadata


# -- /v1/responses -----------------------------------------------------------------------------

# The same functions in the Responses API's flat shape.
FLAT_TOOLS: Any = [{"type": "function", **tool["function"]} for tool in TOOLS]
ASKED = "Turn the kitchen light on."


def _valid_items(items: Any) -> list[tuple[str, dict[str, Any]]]:
    """Each ``function_call`` item's name and parsed arguments, checked against its schema."""
    checked = []
    for item in items:
        assert item.type == "function_call" and item.call_id.startswith("call_")
        assert item.id.startswith("fc_") and item.status == "completed"
        arguments = json.loads(item.arguments)
        jsonschema.validate(arguments, SCHEMAS[item.name])
        checked.append((item.name, arguments))
    return checked


@pytest.mark.timeout(600)
def test_a_response_answers_with_function_call_items_that_validate(client: openai.OpenAI) -> None:
    """``required``: the output is ``function_call`` items only, each valid, and the response
    echoes its tools and choice; a named function is the one called."""
    fields: Any = {"model": MODEL, "input": ASKED, "max_output_tokens": 96, "temperature": 0.7}
    # One call: the answer ends with it, never cut (the random model repeats calls).
    fields["parallel_tool_calls"] = False
    response = client.responses.create(tools=FLAT_TOOLS, tool_choice="required", **fields)
    assert response.status == "completed" and response.output
    assert _valid_items(response.output)
    assert [tool.name for tool in response.tools] == list(SCHEMAS)  # type: ignore[union-attr]
    assert response.tool_choice == "required" and not response.parallel_tool_calls
    assert response.output_text == ""
    named = client.responses.create(
        tools=FLAT_TOOLS, tool_choice={"type": "function", "name": "set_heat"}, **fields
    )
    assert [name for name, _ in _valid_items(named.output)] == ["set_heat"]


@pytest.mark.timeout(600)
def test_a_streamed_response_opens_an_item_per_call_and_streams_its_arguments(
    client: openai.OpenAI,
) -> None:
    """OpenAI's sequence for a call: ``output_item.added`` (a ``function_call`` with no
    arguments yet), ``function_call_arguments.delta``s that join to the arguments,
    ``.done``, ``output_item.done``; the final response holds the same item."""
    events = list(
        client.responses.create(
            model=MODEL,
            input=ASKED,
            tools=FLAT_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=96,
            temperature=0.7,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    deltas: Any = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * len(deltas),
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added: Any = events[2]
    assert added.item.type == "function_call" and added.item.arguments == ""
    joined = "".join(delta.delta for delta in deltas)
    done: Any = events[-3]
    assert done.arguments == joined and done.name == added.item.name
    assert {delta.item_id for delta in deltas} == {added.item.id}
    final: Any = events[-1]
    [item] = final.response.output
    assert (item.id, item.call_id, item.arguments) == (added.item.id, added.item.call_id, joined)
    assert _valid_items([item]) and events[-2].item == item  # type: ignore[union-attr]


def test_a_response_input_with_calls_and_their_outputs_is_the_chat_with_tool_turns(
    client: openai.OpenAI,
) -> None:
    """``function_call`` and ``function_call_output`` items are the chat's assistant
    ``tool_calls`` turn and ``tool`` turn: the same prompt (its token count) and, greedy,
    the same answer as the chat completion of that history."""
    arguments = '{"room": "kitchen", "on": true}'
    items: Any = [
        {"role": "user", "content": ASKED},
        {"type": "function_call", "call_id": "call_1", "name": "set_light", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"ok": true}'},
    ]
    chat: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "set_light", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
    ]
    response = client.responses.create(
        model=MODEL, input=items, tools=FLAT_TOOLS, max_output_tokens=8, temperature=0
    )
    expected = client.chat.completions.create(
        model=MODEL, messages=chat, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert response.usage is not None and expected.usage is not None
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.output_text == (expected.choices[0].message.content or "")


def test_response_tool_requests_the_gateway_refuses(client: openai.OpenAI) -> None:
    """400s naming the parameter: a tool that is no function, a choice of another kind, an
    input item of a kind this gateway does not run, a call without its id."""
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "no"}}, "tool_choice"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
    ]
    for extra, param in bad:
        body: Any = {"model": MODEL, "input": ASKED, "max_output_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(**body)
        assert caught.value.param == param, (extra, caught.value.body)
