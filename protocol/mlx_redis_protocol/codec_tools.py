"""Encoding and validating decoding of the tool-calling fields of jobs and events.

A job offers ``tools`` (functions with a JSON Schema for their arguments) and a
``tool_choice``; a chat history may hold the calls an assistant made and the ``tool`` turns
that answered them; a worker's events carry the calls the model makes, as pieces while it
streams (``delta.tool_calls``) and whole at the end (``done.tool_calls``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from mlx_redis_protocol.fields import FieldReader, is_integer, json_like_problem
from mlx_redis_protocol.messages import (
    TOOL_CHOICE_MODES,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
)

MAX_TOOLS: Final = 128
MAX_TOOL_CALLS: Final = 128
MAX_CALL_ID_LEN: Final = 128
# OpenAI's rule for function names; templates and grammars quote them safely.
TOOL_NAME_RULE: Final = "1-64 characters of a-z, A-Z, 0-9, _ and -"
_TOOL_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


def is_tool_name(value: object) -> bool:
    return isinstance(value, str) and _TOOL_NAME.fullmatch(value) is not None


# -- jobs ------------------------------------------------------------------------------------


def encode_tool(tool: Tool) -> dict[str, Any]:
    fields: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        fields["description"] = tool.description
    if tool.parameters is not None:
        fields["parameters"] = dict(tool.parameters)
    if tool.strict is not None:
        fields["strict"] = tool.strict
    return fields


def encode_tool_choice(choice: object) -> object:
    if not isinstance(choice, ToolChoice):
        return choice  # as it is, for the decoder to refuse
    return {"name": choice.name} if choice.mode == "function" else choice.mode


def encode_tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "name": call.name, "arguments": call.arguments}


def read_tools(reader: FieldReader) -> tuple[Tool, ...] | None:
    items = reader.array("tools", max_items=MAX_TOOLS, min_items=1)
    if items is None:
        return None
    tools = []
    for index, item in enumerate(items):
        entry = reader.nested(f"tools[{index}]", item)
        name = entry.required_string("name")
        if not is_tool_name(name):
            raise entry.error("invalid_field", "name", f"must be {TOOL_NAME_RULE}")
        tools.append(
            Tool(
                name=name,
                description=entry.string("description", max_len=reader.limits.max_str_len),
                parameters=_parameters(entry),
                strict=entry.boolean("strict"),
            )
        )
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise reader.error("invalid_field", "tools", "names a function twice")
    return tuple(tools)


def _parameters(entry: FieldReader) -> dict[str, Any] | None:
    schema = entry.mapping("parameters")
    if schema is None:
        return None
    problem = json_like_problem(schema, entry.limits.max_schema_depth)
    if problem is not None:
        code = "limit_exceeded" if "deeply" in problem else "invalid_field"
        raise entry.error(code, "parameters", problem)
    if schema.get("type", "object") != "object":
        raise entry.error("invalid_field", "parameters", "must be the schema of an object")
    return schema


def read_tool_choice(reader: FieldReader, tools: tuple[Tool, ...] | None) -> ToolChoice | None:
    value = reader.message.get("tool_choice")
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            rule = f"must be one of {', '.join(TOOL_CHOICE_MODES)} or a map with a name"
            raise reader.error("invalid_field", "tool_choice", rule)
        choice = ToolChoice(TOOL_CHOICE_MODES[TOOL_CHOICE_MODES.index(value)])
    elif isinstance(value, dict):
        entry = reader.nested("tool_choice", value)
        choice = ToolChoice("function", entry.required_string("name"))
    else:
        raise reader.error("invalid_field", "tool_choice", "must be a string or a map")
    if choice.mode in ("required", "function") and not tools:
        raise reader.error("invalid_field", "tool_choice", f"{choice.mode!r} needs tools")
    if choice.mode == "function" and choice.name not in {tool.name for tool in tools or ()}:
        raise reader.error("invalid_field", "tool_choice", f"names no tool: {choice.name!r}")
    return choice


def read_message_tool_calls(turn: FieldReader) -> tuple[ToolCall, ...] | None:
    """An assistant turn's ``tool_calls``: each with an id, a function name and its arguments
    as the JSON text of an object."""
    items = turn.array("tool_calls", max_items=MAX_TOOL_CALLS)
    if items is None:
        return None
    return tuple(_tool_call(turn, index, item) for index, item in enumerate(items))


def read_tool_call_id(turn: FieldReader) -> str | None:
    return turn.string("tool_call_id", max_len=MAX_CALL_ID_LEN)


def _tool_call(reader: FieldReader, index: int, item: object) -> ToolCall:
    entry = reader.nested(f"tool_calls[{index}]", item)
    call_id = entry.required_string("id", non_empty=True, max_len=MAX_CALL_ID_LEN)
    name = entry.required_string("name")
    if not is_tool_name(name):
        raise entry.error("invalid_field", "name", f"must be {TOOL_NAME_RULE}")
    arguments = entry.required_string("arguments", max_len=reader.limits.max_str_len)
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise entry.error("invalid_field", "arguments", "must be the JSON text of an object")
    return ToolCall(id=call_id, name=name, arguments=arguments)


# -- events ----------------------------------------------------------------------------------


def encode_tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    fields: dict[str, Any] = {"index": delta.index, "arguments": delta.arguments}
    if delta.id is not None:
        fields["id"] = delta.id
    if delta.name is not None:
        fields["name"] = delta.name
    return fields


def read_tool_call_deltas(reader: FieldReader) -> tuple[ToolCallDelta, ...]:
    items = reader.array("tool_calls", max_items=MAX_TOOL_CALLS)
    deltas = []
    for index, item in enumerate(items or ()):
        entry = reader.nested(f"tool_calls[{index}]", item)
        call_index: Any = entry.message.get("index")
        if not is_integer(call_index) or not 0 <= call_index < MAX_TOOL_CALLS:
            raise entry.error(
                "invalid_field", "index", f"must be an integer in [0, {MAX_TOOL_CALLS})"
            )
        name = entry.string("name")
        if name is not None and not is_tool_name(name):
            raise entry.error("invalid_field", "name", f"must be {TOOL_NAME_RULE}")
        deltas.append(
            ToolCallDelta(
                index=int(call_index),
                id=entry.string("id", non_empty=True, max_len=MAX_CALL_ID_LEN),
                name=name,
                arguments=entry.string("arguments", max_len=reader.limits.max_str_len) or "",
            )
        )
    return tuple(deltas)


def read_tool_calls(reader: FieldReader) -> tuple[ToolCall, ...]:
    items = reader.array("tool_calls", max_items=MAX_TOOL_CALLS)
    return tuple(_tool_call(reader, index, item) for index, item in enumerate(items or ()))
