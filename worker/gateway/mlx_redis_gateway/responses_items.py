"""The Responses API's items and tools, as chat's: what ``/v1/responses`` reads and answers.

A Responses body's ``input`` is a list of items: messages, the model's earlier
``function_call`` items and the caller's ``function_call_output`` items. They become chat
turns (an assistant turn holding the calls in a row, a ``tool`` turn per output), and its
flat ``{"type": "function", "name": …}`` tools and ``tool_choice`` become chat's nested
ones; the chat parser then checks all of it with one set of rules. An answer's output is a
``message`` item for its text and a ``function_call`` item per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlx_redis_gateway.errors import bad_request
from mlx_redis_protocol.identifiers import new_request_id
from mlx_redis_protocol.messages import DoneEvent, ToolCall

_ROLES: Final = ("system", "developer", "user", "assistant")
_TEXT_PARTS: Final = ("input_text", "output_text", "text")
_TOOL_CHOICES: Final = ("auto", "none", "required")


def chat_turns(items: list[object]) -> list[dict[str, Any]]:
    """``input``'s items as chat messages: calls in a row join one assistant turn (the text
    turn just before them, when it holds no calls yet), each output a ``tool`` turn."""
    turns: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        param = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object", param=param)
        if kind == "message":
            turns.append(_message(item, param))
        elif kind == "function_call":
            call = _function_call(item, param)
            last = turns[-1] if turns else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            turns.append(_function_call_output(item, param))
        else:
            raise bad_request(
                f"{param}: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output)",
                param=param,
            )
    return turns


def _message(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(_ROLES)}", param=f"{param}.role")
    return {"role": role, "content": _content(item.get("content"), f"{param}.content")}


def _content(content: object, param: str) -> str | list[dict[str, Any]]:
    """A string, or text parts joined; with ``input_image`` parts, chat's parts (text and
    the images, which the chat parser reads). Anything else is refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of content parts", param=param)
    parts: list[dict[str, Any]] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise bad_request(
                    f"{param}: an input_image needs its image_url (a data: or http(s) URL; "
                    "file_id is not supported)",
                    param=param,
                )
            parts.append(part)
            continue
        if not (
            isinstance(part, dict)
            and part.get("type") in _TEXT_PARTS
            and isinstance(part.get("text"), str)
        ):
            raise bad_request(f"{param} may hold only text and input_image parts", param=param)
        parts.append({"type": "text", "text": part["text"]})
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _function_call(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise bad_request(f"{param}.{field} must be a string", param=f"{param}.{field}")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _function_call_output(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise bad_request(f"{param}.call_id must be a string", param=f"{param}.call_id")
    output = _content(item.get("output"), f"{param}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` (already read by ``chat_turns``) as the items a stored response lists: each
    with its ``id`` (the caller's, else a new one) and ``status``, a message's content as
    parts (``input_text``, or ``output_text`` in an assistant's)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    return [_stored_item(item) for item in value]


def _stored_item(item: Mapping[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    given = item.get("id")
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]
    stored: dict[str, Any] = {
        "id": given if isinstance(given, str) else f"{prefix}_{new_request_id()}",
        "type": kind,
        "status": "completed",
    }
    if kind == "message":
        stored["role"] = item["role"]
        stored["content"] = _stored_parts(item["content"], item["role"])
    else:
        call = kind == "function_call"
        names = ("call_id", "name", "arguments") if call else ("call_id", "output")
        stored.update({name: item[name] for name in names})
    return stored


def _stored_parts(content: str | list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        content = [{"type": kind, "text": content}]
    parts: list[dict[str, Any]] = []
    for part in content:
        if part["type"] == "input_image":
            parts.append({key: part[key] for key in ("type", "image_url", "detail") if key in part})
        elif kind == "output_text":
            parts.append({"type": kind, "text": part["text"], "annotations": []})
        else:
            parts.append({"type": kind, "text": part["text"]})
    return parts


def chat_tools(value: object) -> list[dict[str, Any]] | None:
    """``tools`` (function tools only) in chat's shape."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("tools must be an array", param="tools")
    tools = []
    for index, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(
                f"tools[{index}]: tools of type {kind!r} are not supported (function)",
                param=f"tools[{index}]",
            )
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool
        }
        tools.append({"type": "function", "function": function})
    return tools


def echoed_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools as a response echoes them (the Responses shape)."""
    return [{"type": "function", **tool["function"]} for tool in tools or []]


def chat_tool_choice(value: object) -> object:
    """``auto``, ``none``, ``required`` or ``{"type": "function", "name": …}``, in chat's
    shape."""
    if value is None or value in _TOOL_CHOICES:
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise bad_request(
        "tool_choice must be auto, none, required or {type: function, name}", param="tool_choice"
    )


def output_items(message: dict[str, Any], base_id: str, done: DoneEvent) -> list[dict[str, Any]]:
    """An answer's output: ``message`` (its text item) unless it is calls alone, then a
    ``function_call`` item per call."""
    items = [message] if done.output_text or not done.tool_calls else []
    items += [
        function_call_item(base_id, index, call, "completed")
        for index, call in enumerate(done.tool_calls)
    ]
    return items


def function_call_item(base_id: str, index: int, call: ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{base_id}_{index}",
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
    }
