"""A request's messages, content parts, tools and Responses input items are counted before
anything else is read, and a list over its bound is a 400 ``limit_exceeded`` naming it, in the
error shape of its route. A real gateway, with no worker: a body within its counts gets as far
as the model check (404 ``model_not_found``), one over them never does."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from mlx_redis_gateway.anthropic_api import parse_messages_request
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.openai_api import parse_request
from mlx_redis_gateway.request_counts import RequestCounts
from mlx_redis_gateway.responses_api import parse_responses_request
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_worker.local_redis import RedisServer
from tests.support.gateway import GatewayFactory, GatewayProcess

TEXT = {"type": "text", "text": "hi "}
EMPTY_TOOL: dict[str, Any] = {}


def post(gateway: GatewayProcess, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{gateway.url}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(parts: int = 1, tools: int = 0, messages: int = 1) -> dict[str, Any]:
    turns = [{"role": "user", "content": [TEXT] * parts} for _ in range(messages)]
    body: dict[str, Any] = {"model": "nobody-serves-it", "messages": turns}
    if tools:
        body["tools"] = [
            {"type": "function", "function": {"name": f"tool{index}"}} for index in range(tools)
        ]
    return body


def anthropic(parts: int = 1, tools: int = 0, result_parts: int = 1) -> dict[str, Any]:
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [TEXT] * result_parts}
    body: dict[str, Any] = {
        "model": "nobody-serves-it",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [TEXT] * parts + [result]}],
    }
    if tools:
        schema = {"type": "object"}
        body["tools"] = [{"name": f"tool{index}", "input_schema": schema} for index in range(tools)]
    return body


def responses(items: int = 1, parts: int = 1, tools: int = 0) -> dict[str, Any]:
    item = {"role": "user", "content": [{"type": "input_text", "text": "hi "}] * parts}
    body: dict[str, Any] = {"model": "nobody-serves-it", "input": [item] * items}
    if tools:
        body["tools"] = [EMPTY_TOOL] * tools
    return body


@pytest.fixture(scope="module")
def gateway(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    factory = GatewayFactory(
        tmp_path_factory.mktemp("counts"), redis_server.url, f"h{uuid.uuid4().hex[:12]}"
    )
    try:
        yield factory.start(
            *("--max-messages", "8", "--max-content-parts", "4"),
            *("--max-tools", "3", "--max-input-items", "6"),
        )
    finally:
        factory.stop_all()
        print(factory.report())


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat(parts=5), "messages[0].content"),
        ("/v1/chat/completions", chat(messages=9), "messages"),
        ("/v1/chat/completions", chat(tools=4), "tools"),
        ("/v1/responses", responses(parts=5), "input[0].content"),
        ("/v1/responses", responses(items=7), "input"),
        ("/v1/responses", responses(tools=4), "tools"),
    ],
)
def test_an_openai_body_over_a_count_is_a_400_naming_the_list(
    gateway: GatewayProcess, path: str, body: dict[str, Any], param: str
) -> None:
    status, answer = post(gateway, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "limit_exceeded",
        param,
        "invalid_request_error",
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (anthropic(parts=4), "messages.0.content"),  # four text blocks and the tool result
        (anthropic(result_parts=5), "messages.0.content.1.content"),
        (anthropic(tools=4), "tools"),
    ],
)
def test_a_messages_body_over_a_count_is_a_400_in_anthropics_shape(
    gateway: GatewayProcess, body: dict[str, Any], param: str
) -> None:
    status, answer = post(gateway, "/v1/messages", body)
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"].startswith(f"{param} holds ")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat(parts=4, tools=3, messages=8)),
        ("/v1/responses", responses(items=6, parts=4)),
        ("/v1/messages", anthropic(parts=3, tools=3, result_parts=4)),
    ],
)
def test_a_body_at_its_counts_goes_on_to_the_model_check(
    gateway: GatewayProcess, path: str, body: dict[str, Any]
) -> None:
    status, answer = post(gateway, path, body)
    assert status == 404, answer


def test_ten_thousand_text_parts_are_refused_by_the_default_count() -> None:
    """The defaults: a job turn's 64 parts, 128 tools, 256 messages, 512 input items."""
    refusals = []
    bodies = [
        lambda: parse_request("chat", chat(parts=10_000), limits=DEFAULT_LIMITS),
        lambda: parse_request("chat", chat(parts=65), limits=DEFAULT_LIMITS),
        lambda: parse_messages_request(anthropic(parts=10_000), limits=DEFAULT_LIMITS),
        lambda: parse_responses_request(responses(parts=10_000), limits=DEFAULT_LIMITS),
        lambda: parse_responses_request(responses(items=513), limits=DEFAULT_LIMITS),
        lambda: parse_responses_request(responses(tools=10_000), limits=DEFAULT_LIMITS),
    ]
    for parse in bodies:
        with pytest.raises(ApiError) as refused:
            parse()
        refusals.append((refused.value.status, refused.value.code))
    assert refusals == [(400, "limit_exceeded")] * len(bodies)
    accepted = parse_request("chat", chat(parts=64, tools=128), limits=DEFAULT_LIMITS)
    assert len(accepted.job.tools or ()) == 128


@pytest.mark.parametrize("name", ["max_messages", "max_parts", "max_tools", "max_input_items"])
def test_a_count_below_one_or_tools_past_the_wire_is_no_setting(name: str) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        RequestCounts(**{name: 0})
    with pytest.raises(ValueError, match="at most 128"):
        RequestCounts(max_tools=129)
