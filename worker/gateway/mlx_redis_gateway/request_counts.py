"""How many messages, content parts and tools one request may hold, checked on its decoded
body before any of it is turned into a job.

A worker renders every part and every tool into the prompt (a chat template's loop each) and
tokenizes what that makes, so a request's cost grows with these counts as much as with its
length: one message of 10,000 text parts ran 65.8 s. Counting is the cheapest check there is
(a ``len`` per list, no part read), so it comes first, before the body's fields are read one
by one: a body over a count is a 400 ``limit_exceeded`` naming the list, in the error shape
of its route (OpenAI's; Anthropic's under ``/v1/messages``), whatever its lists hold (a
thousand empty tools are refused as a thousand full ones are).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from mlx_redis_gateway.errors import bad_request
from mlx_redis_protocol.codec_tools import MAX_TOOLS
from mlx_redis_protocol.limits import DEFAULT_LIMITS


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """Most items a request's lists may hold."""

    # Messages of a chat or Messages request (a job holds at most as many turns).
    max_messages: int = DEFAULT_LIMITS.max_messages
    # Content parts (or blocks) of one message, input item, system prompt or tool result: as
    # many as a job's turn may hold, images included.
    max_parts: int = DEFAULT_LIMITS.max_content_parts
    # Tools of one request (a job carries at most ``MAX_TOOLS``).
    max_tools: int = MAX_TOOLS
    # Items of a Responses ``input``: twice the messages, since an agent's calls and their
    # outputs are an item each where chat has a turn for the calls of one answer.
    max_input_items: int = 2 * DEFAULT_LIMITS.max_messages

    def __post_init__(self) -> None:
        for count in fields(self):
            value = getattr(self, count.name)
            if value < 1:
                flag = "--" + count.name.replace("_", "-")
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.max_tools > MAX_TOOLS:
            raise ValueError(f"--max-tools must be at most {MAX_TOOLS}, got {self.max_tools}")


DEFAULT_COUNTS: Final = RequestCounts()


def check_chat(body: Mapping[str, Any], counts: RequestCounts) -> None:
    """A chat completions body: its messages, each one's content parts, its tools."""
    messages = _bounded(body.get("messages"), counts.max_messages, "messages", "messages")
    for index, message in enumerate(messages):
        if isinstance(message, dict):
            where = f"messages[{index}].content"
            _bounded(message.get("content"), counts.max_parts, where, "content parts")
    _bounded(body.get("tools"), counts.max_tools, "tools", "tools")


def check_messages(body: Mapping[str, Any], counts: RequestCounts) -> None:
    """An Anthropic Messages body: its system blocks, messages, each one's blocks and each
    tool result's, its tools."""
    _bounded(body.get("system"), counts.max_parts, "system", "blocks")
    messages = _bounded(body.get("messages"), counts.max_messages, "messages", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        where = f"messages.{index}.content"
        blocks = _bounded(message.get("content"), counts.max_parts, where, "blocks")
        for at, block in enumerate(blocks):
            if isinstance(block, dict) and block.get("type") == "tool_result":
                _bounded(block.get("content"), counts.max_parts, f"{where}.{at}.content", "blocks")
    _bounded(body.get("tools"), counts.max_tools, "tools", "tools")


def check_responses(body: Mapping[str, Any], counts: RequestCounts) -> None:
    """A Responses body: its input items, each one's content parts (or output parts), its
    tools."""
    items = _bounded(body.get("input"), counts.max_input_items, "input", "items")
    for index, item in enumerate(items):
        if isinstance(item, dict):
            for name in ("content", "output"):
                where = f"input[{index}].{name}"
                _bounded(item.get(name), counts.max_parts, where, "content parts")
    _bounded(body.get("tools"), counts.max_tools, "tools", "tools")


def _bounded(value: object, most: int, param: str, what: str) -> list[Any]:
    """``value`` when it is a list of at most ``most`` items; [] when it is no list (the
    field's own parser says what is wrong with it); a 400 when it is longer."""
    if not isinstance(value, list):
        return []
    if len(value) > most:
        raise bad_request(
            f"{param} holds {len(value)} {what}, more than {most}",
            param=param,
            code="limit_exceeded",
        )
    return value
