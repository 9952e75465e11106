"""Anthropic's Messages API bodies → the chat request the gateway queues.

A ``POST /v1/messages`` (or ``/v1/messages/count_tokens``) body is turned into a chat body:
``system`` a system turn first, each user message a user turn (its ``tool_result`` blocks
``tool`` turns of their own, in order), each assistant message an assistant turn holding its
``tool_use`` blocks as calls, image blocks chat's image parts, ``tools`` and ``tool_choice`` in
chat's shape. The chat parser
(``openai_api.parse_request``) then reads it with its one set of rules and limits, so a
Messages job is a chat job in every way that matters to the queue: the same keys, quotas, fair
share and tool grammar. What the chat parser says about a field is said again in this API's
names (``stop_sequences``, ``tools.0.input_schema``).

Fields that need what this gateway does not have (server tools, containers, MCP servers, a
last assistant turn to continue: prefill) are a 400 naming them; fields that change nothing
here (``cache_control``, ``service_tier``, a thinking budget …) are accepted and ignored, as
docs/gateway.md lists.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from mlx_redis_gateway.errors import ApiError, bad_request
from mlx_redis_gateway.openai_api import CompletionRequest, parse_request
from mlx_redis_gateway.request_counts import DEFAULT_COUNTS, RequestCounts, check_messages
from mlx_redis_protocol.identifiers import new_request_id
from mlx_redis_protocol.limits import Limits

# Fields whose value needs what this gateway does not run: a 400 naming them when set.
_UNSUPPORTED: Final = {
    "container": "containers (server-side code execution) are not supported",
    "mcp_servers": "MCP servers are not supported: send their tools as custom tools",
    "context_management": "context management is not supported",
}
_TOOL_CHOICES: Final = {"auto": "auto", "any": "required", "none": "none"}
# Thinking settings → the job's ``thinking`` (None: the model's default).
_THINKING: Final = {"enabled": True, "disabled": False, "adaptive": None}
# A chat turn, or its content, or one of its parts, as the chat parser's errors name them.
_CHAT_PART: Final = re.compile(r"\bmessages\[(\d+)\](\.content(?:\[(\d+)\])?)?")
# Chat parameter names in the chat parser's errors → this API's.
_PARAMS: Final = (
    (re.compile(r"\bstop\b"), "stop_sequences"),
    (re.compile(r"\bresponse_format\b"), "output_config.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools.\1.input_schema"),
    (re.compile(r"\btools\[(\d+)\](?:\.function)?"), r"tools.\1"),
    (re.compile(r"\buser\b"), "metadata.user_id"),
    (re.compile(r"\bchat_template_kwargs\.enable_thinking\b"), "thinking"),
)


def parse_messages_request(
    body: object,
    *,
    limits: Limits,
    user_key: str | None = None,
    count_only: bool = False,
    counts: RequestCounts = DEFAULT_COUNTS,
) -> CompletionRequest:
    """The chat job a Messages body stands for, under a ``msg_`` id, its answer shaped as a
    message; ``count_only``: a ``count_tokens`` body (no ``max_tokens``), whose job only
    counts its prompt; ``counts``: how many messages, blocks and tools it may hold."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_messages(body, counts)
    for name, message in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}):
            raise bad_request(message, param=name)
    turns, origins = _turns(body, limits)
    chat: dict[str, Any] = {"messages": turns}
    for name in ("model", "top_p", "top_k", "priority", "resumable"):
        if name in body:
            chat[name] = body[name]
    if count_only:
        chat["max_tokens"] = 1  # a worker that predates count_only runs it: one token
    else:
        if body.get("max_tokens") is None:
            raise bad_request("max_tokens: Field required", param="max_tokens")
        chat["max_tokens"] = body["max_tokens"]
        chat["stream"] = body.get("stream", False)
        chat |= _sampling(body)
    chat |= _tool_fields(body)
    chat |= _output_fields(body)
    try:
        accepted = parse_request("chat", chat, limits=limits, user_key=user_key, counts=counts)
    except ApiError as error:
        raise _in_anthropic_terms(error, origins) from error
    if count_only and accepted.job.has_media():
        raise bad_request(
            "count_tokens cannot count images: their tokens are made by the model's vision "
            "processor on a worker, which a count does not run",
            param="messages",
        )
    job = replace(accepted.job, request_id=f"msg_{new_request_id()}", count_only=count_only or None)
    return replace(accepted, kind="messages", job=job)


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """``temperature`` (Anthropic's range, 0 to 1), ``stop_sequences`` and
    ``metadata.user_id``, as the chat body's."""
    chat: dict[str, Any] = {}
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            raise bad_request("temperature: must be a number", param="temperature")
        if not 0 <= temperature <= 1:
            raise bad_request("temperature: must be between 0 and 1", param="temperature")
        chat["temperature"] = temperature
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise bad_request("stop_sequences: must be an array of strings", "stop_sequences")
        chat["stop"] = stops
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request("metadata: must be an object", param="metadata")
        if metadata.get("user_id") is not None:
            chat["user"] = metadata["user_id"]
    return chat


def _tool_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``thinking`` as the chat body's."""
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = _tool_choice(choice)
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in _THINKING:
            raise bad_request(
                "thinking.type: must be one of enabled, disabled, adaptive", param="thinking"
            )
        if _THINKING[kind] is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": _THINKING[kind]}
    return chat


def _output_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """``output_config.format`` (a JSON schema the text must match) as a ``response_format``;
    ``output_config.effort`` is ignored."""
    config = body.get("output_config")
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise bad_request("output_config: must be an object", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(
            "output_config.format: must be {type: json_schema, schema}",
            param="output_config.format",
        )
    return {
        "response_format": {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    }


def _tools(value: object) -> list[dict[str, Any]]:
    """Custom tools (``name``, ``description``, ``input_schema``) as chat's function tools;
    server tools (``web_search_…``, ``bash_…`` …) are refused."""
    if not isinstance(value, list):
        raise bad_request("tools: must be an array", param="tools")
    tools = []
    for index, tool in enumerate(value):
        param = f"tools.{index}"
        kind = tool.get("type") if isinstance(tool, dict) else "?"
        if not isinstance(tool, dict) or kind not in (None, "custom"):
            raise bad_request(
                f"{param}: tools of type {kind!r} are not supported (custom tools only)", param
            )
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"{param}.input_schema: must be an object", param=param)
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: object) -> tuple[object, bool | None]:
    """``{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`` as
    chat's ``tool_choice`` and ``parallel_tool_calls``."""
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(value, dict) or (kind not in _TOOL_CHOICES and kind != "tool"):
        raise bad_request(
            "tool_choice.type: must be one of auto, any, tool, none", param="tool_choice"
        )
    choice: object = _TOOL_CHOICES.get(kind)
    if kind == "tool":
        choice = {"type": "function", "function": {"name": value.get("name")}}
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad_request(
            "tool_choice.disable_parallel_tool_use: must be a boolean", param="tool_choice"
        )
    return choice, None if disable is None else not disable


@dataclass(frozen=True, slots=True)
class _Origin:
    """Where a chat turn came from: its message (or block), the blocks its content parts are,
    and the first of those blocks' index (None: its parts are not one block each)."""

    turn: str
    content: str
    first: int | None = 0

    def of(self, part: str | None, index: str | None) -> str:
        if part is None:
            return self.turn
        if index is None or self.first is None:
            return self.content
        return f"{self.content}.{self.first + int(index)}"


def _turns(body: Mapping[str, Any], limits: Limits) -> tuple[list[dict[str, Any]], list[_Origin]]:
    """``system`` and ``messages`` as chat turns (text blocks as chat's text parts, image
    blocks as its image parts), and where each came from."""
    turns: list[dict[str, Any]] = []
    origins: list[_Origin] = []
    system = body.get("system")
    if system is not None and system not in ("", []):
        turns.append({"role": "system", "content": _text_parts(system, "system")})
        origins.append(_Origin("system", "system"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty array", param="messages")
    for index, message in enumerate(messages):
        param = f"messages.{index}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{param}.role: must be user or assistant", param=param)
        assert isinstance(message, dict)
        content = message.get("content")
        if role == "user":
            for turn, origin in _user_turns(content, f"{param}.content"):
                turns.append(turn)
                origins.append(origin)
        else:
            turns.append(_assistant_turn(content, f"{param}.content"))
            origins.append(_Origin(param, f"{param}.content", None))
    if messages[-1]["role"] == "assistant":
        raise bad_request(
            "prefilling the answer (a last message of role assistant) is not supported: end "
            "with a user message",
            param=f"messages.{len(messages) - 1}",
        )
    return turns, origins


def _blocks(content: object, param: str) -> list[dict[str, Any]]:
    """A message's content blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{param}: must be a string or an array of content blocks", param)
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{param}.{index}: must be a content block with a type", param)
    return content


def _user_turns(content: object, param: str) -> list[tuple[dict[str, Any], _Origin]]:
    """A user message's turns, in order: its text and images as user turns, each
    ``tool_result`` a ``tool`` turn."""
    message = param.removesuffix(".content")
    turns: list[tuple[dict[str, Any], _Origin]] = []
    parts: list[dict[str, Any]] | None = None
    for index, block in enumerate(_blocks(content, param)):
        where = f"{param}.{index}"
        if block["type"] == "tool_result":
            parts = None
            turns.append((_tool_result(block, where), _Origin(where, f"{where}.content")))
            continue
        if parts is None:
            parts = []
            turns.append(({"role": "user", "content": parts}, _Origin(message, param, index)))
        parts.append(
            _image_part(block, where) if block["type"] == "image" else _text_part(block, where)
        )
    return turns or [({"role": "user", "content": ""}, _Origin(message, param))]


def _assistant_turn(content: object, param: str) -> dict[str, Any]:
    """An assistant message's turn: its text, and its ``tool_use`` blocks as calls. Its
    thinking blocks are left out (templates drop earlier turns' thoughts)."""
    parts: list[dict[str, Any]] = []
    calls = []
    for index, block in enumerate(_blocks(content, param)):
        where = f"{param}.{index}"
        if block["type"] in ("thinking", "redacted_thinking"):
            continue
        if block["type"] == "tool_use":
            calls.append(_tool_use(block, where))
        else:
            parts.append(_text_part(block, where))
    turn: dict[str, Any] = {"role": "assistant", "content": parts}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _image_part(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    """An image block (``base64`` data, or a ``url``) as chat's ``image_url`` part: the chat
    parser bounds, checks and stages it as the OpenAI routes' images are."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        assert isinstance(source, dict)
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise bad_request(f"{param}.source: needs media_type and data strings", param=param)
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        assert isinstance(source, dict)
        return {"type": "image_url", "image_url": {"url": source.get("url")}}
    raise bad_request(
        f"{param}.source.type: must be base64 or url (file images need a file store)", param
    )


def _text_part(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    kind = block["type"]
    if kind == "image":
        raise bad_request(
            f"{param}: images are taken in a user message's content only (as chat takes them)",
            param=param,
        )
    if kind != "text":
        raise bad_request(
            f"{param}: blocks of type {kind!r} are not supported here (text, image, tool_use, "
            "tool_result, thinking)",
            param=param,
        )
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{param}.text: must be a string", param=param)
    return {"type": "text", "text": block["text"]}


def _text_parts(content: object, param: str) -> list[dict[str, Any]]:
    return [
        _text_part(block, f"{param}.{index}") for index, block in enumerate(_blocks(content, param))
    ]


def _tool_use(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str):
            raise bad_request(f"{param}.{name}: must be a string", param=param)
    if not isinstance(block.get("input"), dict):
        raise bad_request(f"{param}.input: must be an object", param=param)
    function = {"name": block["name"], "arguments": block["input"]}
    return {"id": block["id"], "type": "function", "function": function}


def _tool_result(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A ``tool_result`` block as a ``tool`` turn (``is_error`` is not shown to the model:
    chat templates have no place for it)."""
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"{param}.tool_use_id: must be a string", param=param)
    content = block.get("content")
    parts = [] if content is None else _text_parts(content, f"{param}.content")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": parts}


def _in_anthropic_terms(error: ApiError, origins: list[_Origin]) -> ApiError:
    """The chat parser's error, the parameter it names in this API's terms (in its message
    too): a chat turn's part named by the message and block it came from."""

    def origin(match: re.Match[str]) -> str:
        turn = int(match[1])
        return origins[turn].of(match[2], match[3]) if turn < len(origins) else match[0]

    error.message = _CHAT_PART.sub(origin, error.message)
    if error.param is not None:
        error.param = _CHAT_PART.sub(origin, error.param)
    for pattern, name in _PARAMS:
        if error.param is not None and pattern.search(error.param):
            error.message = pattern.sub(name, error.message)
            error.param = pattern.sub(name, error.param)
    return error
