"""Tool calls from a real instruct model, SmolLM2-135M (its own ChatML template, which knows
no tools: the fallback prompt), through a real gateway and worker, as OpenAI's client sees
them: parallel calls that all validate, streamed fragments that join to them, a named
function, a history with tool turns, the Responses API's ``function_call`` items, and a tool
round trip over Anthropic's Messages API.

Sampled at 0.7 with seeds: with this prompt SmolLM2 called both functions for 4 of the seeds
0 to 7 (the engine alone, when this was written)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from mlx_redis_worker.local_redis import RedisServer
from tests.gateway.conftest import Fleet, running_fleet
from tests.support.gateway import GatewayProcess
from tests.support.sse import anthropic_message, count_tokens

MODEL = "smollm2"
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"],
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
DESCRIPTIONS = {"get_weather": "Current weather in a city", "get_time": "Local time in a zone"}
TOOLS: Any = [
    {
        "type": "function",
        "function": {"name": name, "description": DESCRIPTIONS[name], "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
REQUEST: Any = {
    "model": MODEL,
    "messages": ASK,
    "tools": TOOLS,
    "tool_choice": "required",
    "temperature": 0.7,
    "max_tokens": 160,
    "seed": 2,
}


@pytest.fixture(scope="module")
def fleet(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    directory = tmp_path_factory.mktemp("smollm2-fleet")
    with running_fleet(redis_server, directory, MODEL, max_concurrency=4) as fleet:
        yield fleet


def _checked(name: str, arguments: str) -> tuple[str, dict[str, Any]]:
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return name, parsed


@pytest.mark.timeout(600)
def test_parallel_calls_validate_and_stream_as_fragments_that_join_to_them(
    client: openai.OpenAI, fleet: Fleet
) -> None:
    """Sampled, an answer may hold one call or several; seeds that made several when this
    test was written are tried until one does (a prefix-cache hit may shift the numbers).
    The stream's fragments, joined per index, are the calls its request ended with."""
    parallel = []
    for seed in (2, 1, 6, 7):
        choice = client.chat.completions.create(**{**REQUEST, "seed": seed}).choices[0]
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
        calls = [_checked(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls or choice.finish_reason == "length"
        if len(calls) >= 2:
            parallel = calls
            break
    assert {name for name, _ in parallel} == set(SCHEMAS), parallel

    streamed: dict[int, list[str]] = {}
    request_id = ""
    for chunk in client.chat.completions.create(stream=True, **REQUEST):
        request_id = chunk.id
        for piece in chunk.choices[0].delta.tool_calls or ():
            assert piece.function is not None
            call = streamed.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
    joined = [(name, arguments) for name, arguments in (streamed[i] for i in sorted(streamed))]
    done = fleet.logged_done(request_id)
    assert joined == [(call.name, call.arguments) for call in done.tool_calls]
    assert all(_checked(name, arguments) for name, arguments in joined)


@pytest.mark.timeout(600)
def test_a_named_function_and_a_history_with_tool_turns(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        **{**REQUEST, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    [call] = named.choices[0].message.tool_calls or ()
    assert _checked(call.function.name, call.function.arguments)[0] == "get_time"

    history: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_w",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_w",
            "content": '{"temperature": 18, "sky": "clear"}',
        },
    ]
    after = client.chat.completions.create(
        **{**REQUEST, "messages": history, "tool_choice": "none", "max_tokens": 24}
    )
    without = client.chat.completions.create(**{**REQUEST, "tool_choice": "none", "max_tokens": 1})
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls
    assert after.usage is not None and without.usage is not None
    assert after.usage.prompt_tokens > without.usage.prompt_tokens  # the tool turns are in it


@pytest.mark.timeout(600)
def test_a_response_holds_a_function_call_item_per_call(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL,
        input=ASK[0]["content"],
        tools=[{"type": "function", **tool["function"]} for tool in TOOLS],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, so never cut (the Responses API has no seed)
        temperature=0.7,
        max_output_tokens=160,
    )
    assert response.status == "completed"
    [item] = response.output
    assert item.type == "function_call" and item.call_id.startswith("call_")
    _checked(item.name, item.arguments)


# -- Anthropic's Messages API ---------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_messages_tool_round_trip_in_raw_http(gateway: GatewayProcess) -> None:
    """A forced call streamed as Anthropic's events (its ``input_json_delta``s join to an
    input that validates and names the city asked about), then its ``tool_result`` sent back:
    with ``tool_choice: none`` the answer is text, its prompt longer than the question's alone
    (``count_tokens``) by the turns sent back."""
    tools: Any = [
        {"name": name, "description": DESCRIPTIONS[name], "input_schema": schema}
        for name, schema in SCHEMAS.items()
    ]
    base: Any = {"model": MODEL, "max_tokens": 48, "tools": tools, "temperature": 0}
    history: list[Any] = [{"role": "user", "content": ASK[0]["content"]}]
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    called = anthropic_message(gateway.url, {**base, "messages": history, "tool_choice": choice})
    assert called["stop_reason"] == "tool_use", called
    [call] = called["content"]
    assert _checked(call["name"], json.dumps(call["input"]))[1]["city"] == "Paris"
    history += [
        {"role": "assistant", "content": called["content"]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18 C"}],
        },
    ]
    after: Any = {"messages": history, "tool_choice": {"type": "none"}, "stream": False}
    after["max_tokens"] = 12  # a few words of text are enough
    answer = anthropic_message(gateway.url, {**base, **after})
    assert answer["stop_reason"] in ("end_turn", "max_tokens") and answer["content"][0]["text"]
    usage = answer["usage"]
    alone = count_tokens(
        gateway.url, {**base, "messages": history[:1], "tool_choice": {"type": "none"}}
    )
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > alone
