"""A Messages request's protocol events → Anthropic's message object, or its event stream.

The stream is what Anthropic's SDKs parse: ``message_start`` and a ``ping``, then a content
block per part of the answer as it arrives (``content_block_start``, its
``content_block_delta``s: ``thinking_delta`` for a reasoning model's thought, ``text_delta``
for text, ``input_json_delta`` for a call's arguments; ``content_block_stop`` when the next one
begins or the answer ends), then ``message_delta`` (``stop_reason``, ``stop_sequence``, usage)
and ``message_stop``; an ``error`` event when the request fails.

The text, thought and call pieces come through the chat ``Shaper`` (``shaping``), so the stream
is a pure function of the request's events, as a chat stream is: a job re-run after a worker
crash streams on where it was, and any gateway resumes it after the ``Last-Event-ID`` a client
names. Each protocol event's SSE messages leave together and only the last carries the event's
seq as its id: a client with that id has all of them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Final

from sse_starlette import ServerSentEvent

from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.shaping import Chunk, ResponseShape, Shaper
from mlx_redis_protocol.messages import DoneEvent, Event, Usage

# What the answer's stop reason is for each protocol finish reason (an answer that ended with
# calls: ``tool_use``). ``abort`` and ``expired`` have no Anthropic name and keep their own.
_STOP_REASONS: Final = {"stop": "end_turn", "length": "max_tokens"}
_PING: Final = b'event: ping\r\ndata: {"type":"ping"}\r\n\r\n'


class AnthropicPing(ServerSentEvent):
    """A quiet Messages stream's keep-alive: Anthropic's own ``ping`` event (its SDKs skip
    it), with no id."""

    def encode(self) -> bytes:
        return _PING


class MessageFrames:
    """Feeds on one Messages request's events in seq order; says what to send for each."""

    def __init__(self, request_id: str, shape: ResponseShape) -> None:
        self.request_id = request_id
        self.model = shape.model
        # The text, thought and calls as chat chunks (without logprobs or a usage chunk).
        self.shaper = Shaper(request_id, replace(shape, kind="chat"))
        self.blocks = 0  # content blocks opened so far (the next one's index)
        self.open: str | None = None  # the open block's type ("text", "thinking", "tool_use")

    def opening(self) -> bytes:
        """The first messages (seq 0's): ``message_start``, with no content yet, and a
        ``ping``."""
        message: dict[str, Any] = {
            "id": self.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # The gateway learns the prompt's length at the end: message_delta says it.
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return frame([{"type": "message_start", "message": message}, {"type": "ping"}], 0)

    def feed(self, event: Event, after: int) -> bytes:
        """The messages ``event`` adds to the stream, if its seq is past ``after`` (every event
        is read: the blocks opened so far depend on all of them)."""
        messages: list[dict[str, Any]] = []
        for chunk in self.shaper.feed(event):
            if self.shaper.error is not None:
                return self.failed(self.shaper.error) if event.seq > after else b""
            messages += self._from_chunk(chunk)
        if isinstance(event, DoneEvent):
            messages += self._closing(event)
        return frame(messages, event.seq) if event.seq > after and messages else b""

    def failed(self, error: ApiError) -> bytes:
        """The last message of a request that failed."""
        return frame([error.anthropic_body()], None)

    def _from_chunk(self, chunk: Chunk) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        for choice in chunk.data.get("choices", ()):
            delta = choice.get("delta") or {}
            thought = delta.get("reasoning_content")
            if thought:
                messages += self._into("thinking", {"thinking": "", "signature": ""})
                messages.append(self._delta({"type": "thinking_delta", "thinking": thought}))
            for piece in delta.get("tool_calls") or ():
                function = piece.get("function") or {}
                if piece.get("id") is not None:
                    block = {"id": piece["id"], "name": function.get("name"), "input": {}}
                    messages += self._close() + self._open("tool_use", block)
                if function.get("arguments"):
                    json_delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    messages.append(self._delta(json_delta))
            text = delta.get("content")
            if text:
                messages += self._into("text", {"text": ""})
                messages.append(self._delta({"type": "text_delta", "text": text}))
        return messages

    def _closing(self, done: DoneEvent) -> list[dict[str, Any]]:
        """The open block's end, then the message's: its stop reason and usage. An answer with
        nothing in it still has its one (empty) text block, as the whole message has."""
        messages = (
            self._close() if self.blocks else self._open("text", {"text": ""}) + self._close()
        )
        stop = {"stop_reason": stop_reason(done), "stop_sequence": done.stop_sequence}
        messages.append({"type": "message_delta", "delta": stop, "usage": usage_body(done.usage)})
        messages.append({"type": "message_stop"})
        return messages

    def _into(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Open a block of ``kind`` unless it is the open one."""
        return [] if self.open == kind else self._close() + self._open(kind, block)

    def _open(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.open = kind
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.blocks - 1}
        return [{**start, "content_block": {"type": kind, **block}}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}


def frame(messages: list[dict[str, Any]], seq: int | None) -> bytes:
    """SSE messages, each named by its type; the last one's id ``seq`` (none when None)."""
    out = []
    for position, data in enumerate(messages):
        named = b"event: %s\r\ndata: %s\r\n\r\n" % (
            data["type"].encode(),
            json.dumps(data, separators=(",", ":")).encode(),
        )
        last = position == len(messages) - 1
        out.append(b"id: %d\r\n%s" % (seq, named) if last and seq is not None else named)
    return b"".join(out)


def message_object(shaper: Shaper) -> dict[str, Any]:
    """A finished request's message: its thought, its text, a ``tool_use`` block per call
    (an answer with nothing in it has one empty text block)."""
    if shaper.error is not None:
        raise shaper.error
    done = shaper.done
    assert done is not None
    content: list[dict[str, Any]] = []
    if done.reasoning_text:
        content.append({"type": "thinking", "thinking": done.reasoning_text, "signature": ""})
    if done.output_text or not (content or done.tool_calls):
        content.append({"type": "text", "text": done.output_text})
    for call in done.tool_calls:
        block = {"type": "tool_use", "id": call.id, "name": call.name}
        content.append({**block, "input": _input(call.arguments)})
    return {
        "id": shaper.request_id,
        "type": "message",
        "role": "assistant",
        "model": shaper.shape.model,
        "content": content,
        "stop_reason": stop_reason(done),
        "stop_sequence": done.stop_sequence,
        "usage": usage_body(done.usage),
    }


def stop_reason(done: DoneEvent) -> str:
    """``stop_sequence`` when one of the request's ended the answer, else ``tool_use`` when
    the model ended it with calls, else the finish reason's name."""
    if done.finish_reason == "stop" and done.stop_sequence is not None:
        return "stop_sequence"
    if done.tool_calls and done.finish_reason == "stop":
        return "tool_use"
    return _STOP_REASONS.get(done.finish_reason, done.finish_reason)


def usage_body(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt's tokens the prefix cache did not
    hold (those it held are ``cache_read_input_tokens``; the three input counts add up to the
    prompt, as Anthropic's do)."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its ``input`` object (the tool grammar made them one)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(500, "a worker sent a call whose arguments are no JSON object", "api_error")
    return value
