"""A request's protocol events → OpenAI's chunks and completion objects.

The shaper is a pure function of the event sequence: a gateway that resumes a stream (any
gateway, after ``Last-Event-ID``) feeds it the request's log from the start, drops the chunks
the client already has (those of events up to that seq), and sends the rest: the same chunks
the first gateway would have sent. Each chunk's SSE id is the seq of the event it came from.

A job re-run after a worker failure starts again (a ``reset`` event), but text already sent
cannot be taken back. The new attempt is matched against what was sent: while it repeats it
(a seeded or greedy re-run does), nothing goes out; past it, only the new text does. If it
differs, the stream ends with a ``stream_rewritten`` error instead of sending a corrupt answer.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from mlx_redis_gateway.errors import ApiError, from_error_event
from mlx_redis_protocol.messages import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    QueuedEvent,
    ResetEvent,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)

# The answer's API: chat or text completions (OpenAI's chunks), or Anthropic's Messages (its
# events, ``anthropic_shaping``, made from the chat chunks of the same events).
Kind = Literal["chat", "text", "messages"]
KINDS: Final[tuple[Kind, ...]] = ("chat", "text", "messages")


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What a gateway stores per request (``mlxw:gateway:{id}``), so that any gateway can
    stream it again: the answer's form and who may read it."""

    kind: Kind
    model: str
    created: int
    include_usage: bool = False
    logprobs: bool = False
    owner: str | None = None  # the API key name that made it; None: made without auth

    def encode(self) -> str:
        return json.dumps(
            {
                "kind": self.kind,
                "model": self.model,
                "created": self.created,
                "include_usage": self.include_usage,
                "logprobs": self.logprobs,
                "owner": self.owner,
            }
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> ResponseShape | None:
        try:
            value = json.loads(raw)
            kind = value["kind"]
            if kind not in KINDS:
                return None
            return cls(
                kind=kind,
                model=str(value["model"]),
                created=int(value["created"]),
                include_usage=bool(value.get("include_usage")),
                logprobs=bool(value.get("logprobs")),
                owner=value.get("owner") if isinstance(value.get("owner"), str) else None,
            )
        except (ValueError, KeyError, TypeError):
            return None


@dataclass(frozen=True, slots=True)
class Chunk:
    """One SSE message: the seq of the event it came from, its JSON data, and whether the seq
    is sent as its SSE id (a resumed stream starts after the last id the client saw)."""

    seq: int
    data: dict[str, Any]
    has_id: bool = True


class _Output:
    """Text and token ids, appended to as deltas come; the text is joined only when read
    (after a reset), so a long answer costs the same per token as a short one."""

    __slots__ = ("_pieces", "length", "tokens")

    def __init__(self, text: str = "", tokens: list[int] | None = None) -> None:
        self._pieces = [text] if text else []
        self.length = len(text)
        self.tokens: list[int] = list(tokens) if tokens else []

    def add(self, text: str, tokens: tuple[int, ...]) -> None:
        if text:
            self._pieces.append(text)
            self.length += len(text)
        self.tokens.extend(tokens)

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


class Shaper:
    """Feeds on one request's events in seq order; says what to send for each."""

    def __init__(self, request_id: str, shape: ResponseShape, *, streaming: bool = True) -> None:
        """``streaming`` False: only the final answer is wanted (``completion``), so a re-run
        that differs from an earlier attempt is no error: nothing of that one was sent."""
        self.request_id = request_id
        self.shape = shape
        self.streaming = streaming
        self.attempt = _Output()  # the current attempt's own output
        # What the client has, across attempts: the attempt itself, except after a reset
        # until the re-run has caught up with what the earlier attempt sent.
        self.sent = self.attempt
        self.attempt_logprobs: list[TokenLogprob] = []
        self.offsets = _TextOffsets()  # of the attempt's logprob tokens in its text
        # The current attempt's thought and call pieces, and how much of them the client has
        # (a re-run after a reset repeats them: only what is past that goes out).
        self.attempt_reasoning = ""
        self.attempt_calls: dict[int, _CallSoFar] = {}
        self.reasoning_sent = 0
        self.calls_sent: dict[int, int] = {}  # index -> argument characters sent
        self.done: DoneEvent | None = None
        self.error: ApiError | None = None

    @property
    def finished(self) -> bool:
        return self.done is not None or self.error is not None

    def feed(self, event: Event) -> list[Chunk]:
        """The chunks ``event`` adds to the stream (none for most non-delta events)."""
        if isinstance(event, QueuedEvent):
            return []  # the role chunk goes out once, from ``opening``
        if isinstance(event, ResetEvent):
            self.attempt = _Output()
            self.attempt_logprobs = []
            self.offsets = _TextOffsets()
            self.attempt_reasoning = ""
            self.attempt_calls = {}
            return []
        if isinstance(event, DeltaEvent):
            return self._delta(event)
        if isinstance(event, DoneEvent):
            self.done = event
            return self._closing(event)
        if isinstance(event, ErrorEvent):
            self.error = from_error_event(event.code, event.message)
            return [Chunk(event.seq, self.error.body())]
        return []  # an event type of a newer protocol: nothing to show

    def opening(self) -> Chunk:
        """The first chunk (seq 0, the queued marker's): the role, and the id to resume by."""
        if self.shape.kind == "chat":
            return Chunk(0, self._chunk({"role": "assistant", "content": ""}, None))
        return Chunk(0, self._chunk("", None))

    def _delta(self, event: DeltaEvent) -> list[Chunk]:
        self.attempt.add(event.new_text, event.new_token_ids)
        if event.logprobs:
            self.attempt_logprobs += event.logprobs
            self.offsets.add(event.logprobs)
        self.attempt_reasoning += event.reasoning
        for piece in event.tool_calls:
            call = self.attempt_calls.setdefault(piece.index, _CallSoFar())
            call.add(piece)
        if not self.streaming:
            return []
        chunks = self._thought_and_calls(event)
        return chunks + self._text_delta(event)

    def _thought_and_calls(self, event: DeltaEvent) -> list[Chunk]:
        """Chat chunks for what is new of the thought and of the calls (pieces in OpenAI's
        ``delta.tool_calls`` shape: a call's first one with its id and name)."""
        if self.shape.kind != "chat":
            return []
        chunks = []
        reasoning = self.attempt_reasoning[self.reasoning_sent :]
        if reasoning:
            self.reasoning_sent = len(self.attempt_reasoning)
            chunks.append(Chunk(event.seq, self._chunk({"reasoning_content": reasoning}, None)))
        pieces = []
        for index in sorted({piece.index for piece in event.tool_calls}):
            call = self.attempt_calls[index]
            sent = self.calls_sent.get(index)
            piece: dict[str, Any] = {"index": index}
            if sent is None:
                if call.name is None:
                    continue
                sent = 0
                piece |= {"id": call.id, "type": "function"}
                piece["function"] = {"name": call.name, "arguments": ""}
            arguments = call.arguments[sent:]
            if arguments:
                piece.setdefault("function", {})["arguments"] = arguments
            elif "id" not in piece:
                continue
            self.calls_sent[index] = len(call.arguments)
            pieces.append(piece)
        if pieces:
            chunks.append(Chunk(event.seq, self._chunk({"tool_calls": pieces}, None)))
        return chunks

    def _text_delta(self, event: DeltaEvent) -> list[Chunk]:
        if self.attempt is self.sent:
            new_text, new_logprobs = event.new_text, list(event.logprobs or ())
        else:
            replayed = self._replayed()
            if replayed is None:
                self.error = ApiError(
                    500,
                    f"request {self.request_id} was run again after a worker failure and its "
                    "new output differs from what was already streamed; send the request again",
                    "server_error",
                    code="stream_rewritten",
                )
                return [Chunk(event.seq, self.error.body())]
            new_text, new_logprobs = replayed
        if not new_text and not (self.shape.logprobs and new_logprobs):
            return []
        first = len(self.attempt_logprobs) - len(new_logprobs)
        logprobs = self._logprobs(new_logprobs, first) if self.shape.logprobs else None
        if self.shape.kind == "chat":
            return [Chunk(event.seq, self._chunk({"content": new_text}, None, logprobs))]
        return [Chunk(event.seq, self._chunk(new_text, None, logprobs))]

    def _replayed(self) -> tuple[str, list[TokenLogprob]] | None:
        """A re-run's delta checked against what the client has: what is new to it (text and
        logprobs past what was sent), or None when the re-run differs from it."""
        attempt, sent = self.attempt, self.sent
        attempt_text, sent_text = attempt.text, sent.text
        overlap = min(len(attempt.tokens), len(sent.tokens))
        text_overlap = min(attempt.length, sent.length)
        if (
            attempt.tokens[:overlap] != sent.tokens[:overlap]
            or attempt_text[:text_overlap] != sent_text[:text_overlap]
        ):
            return None
        new_text = attempt_text[sent.length :]
        new_logprobs = self.attempt_logprobs[len(sent.tokens) :]
        if attempt.length >= sent.length and len(attempt.tokens) >= len(sent.tokens):
            self.sent = attempt  # caught up: from here on the attempt is what was sent
        else:  # ahead in text or in tokens only (a detokenizer holds text back)
            self.sent = _Output(
                max(attempt_text, sent_text, key=len),
                max(attempt.tokens, sent.tokens, key=len),
            )
        return new_text, new_logprobs

    def _closing(self, event: DoneEvent) -> list[Chunk]:
        empty: dict[str, Any] | str = {} if self.shape.kind == "chat" else ""
        # With a usage chunk after it, the closing chunk carries no id: a client that lost
        # the usage chunk resumes before both and gets both again.
        closing = self._chunk(empty, finish_reason(event))
        if event.output_valid is not None:  # this gateway's extension: did it match the format?
            closing["choices"][0]["output_valid"] = event.output_valid
        chunks = [Chunk(event.seq, closing, has_id=not self.shape.include_usage)]
        if self.shape.include_usage:
            usage_chunk = self._envelope("chat.completion.chunk")
            if self.shape.kind == "text":
                usage_chunk["object"] = "text_completion"
            usage_chunk["choices"] = []
            usage_chunk["usage"] = usage_body(event.usage)
            chunks.append(Chunk(event.seq, usage_chunk))
        return chunks

    def _chunk(
        self, delta: dict[str, Any] | str, finish_reason: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        if self.shape.kind == "chat":
            body = self._envelope("chat.completion.chunk")
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            body = self._envelope("text_completion")
            choice = {"index": 0, "text": delta}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        return body

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.shape.created,
            "model": self.shape.model,
            "system_fingerprint": None,
        }

    def _logprobs(self, items: list[TokenLogprob], first: int = 0) -> dict[str, Any]:
        """OpenAI's logprobs for ``items`` (the attempt's from index ``first``). A token is
        named by its text, with its UTF-8 bytes, as the worker sent them; a token that splits a
        character shows U+FFFD for its part of it (its bytes are exact). A worker that sent no
        bytes leaves the gateway (which has no tokenizer) naming the token by its id
        (``token_id:123``, as vLLM's ``return_tokens_as_token_ids`` does), bytes null."""
        if self.shape.kind == "chat":
            return {
                "content": [
                    {
                        **token_entry(item.token_id, item.token_bytes),
                        "logprob": item.logprob,
                        "top_logprobs": [
                            {**token_entry(token, token_bytes), "logprob": logprob}
                            for (token, logprob), token_bytes in _with_bytes(item)
                        ],
                    }
                    for item in items
                ]
            }
        return {
            "tokens": [token_text(item.token_id, item.token_bytes) for item in items],
            "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [_top_by_text(item) for item in items],
            "text_offset": self.offsets.of(first, len(items)),
        }

    def completion(self) -> dict[str, Any]:
        """The non-streaming answer, once the request is done (its final attempt's text)."""
        assert self.done is not None
        done = self.done
        logprobs = self._logprobs(self.attempt_logprobs) if self.shape.logprobs else None
        if self.shape.kind == "chat":
            body = self._envelope("chat.completion")
            message: dict[str, Any] = {"role": "assistant", "content": done.output_text}
            if done.tool_calls:
                message["content"] = done.output_text or None
                message["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for call in done.tool_calls
                ]
            if done.reasoning_text:
                message["reasoning_content"] = done.reasoning_text
            message["refusal"] = None
            choice: dict[str, Any] = {"index": 0, "message": message}
        else:
            body = self._envelope("text_completion")
            choice = {"index": 0, "text": done.output_text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason(done)
        if done.output_valid is not None:
            choice["output_valid"] = done.output_valid
        body["choices"] = [choice]
        body["usage"] = usage_body(done.usage)
        return body


class _CallSoFar:
    """One call of the current attempt, as its pieces have built it."""

    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name: str | None = None
        self.arguments = ""

    def add(self, piece: ToolCallDelta) -> None:
        if piece.id is not None:
            self.id = piece.id
        if piece.name is not None:
            self.name = piece.name
        self.arguments += piece.arguments


def finish_reason(done: DoneEvent) -> str:
    """OpenAI's: ``tool_calls`` when the model ended its answer with calls."""
    return "tool_calls" if done.tool_calls and done.finish_reason == "stop" else done.finish_reason


DONE_MESSAGE: Final = b"data: [DONE]\r\n\r\n"


def sse_message(chunk: Chunk) -> bytes:
    """The chunk as one SSE message (bytes: sse-starlette passes them through as they are)."""
    if chunk.has_id:
        return b"id: %d\r\n%s" % (chunk.seq, sse_data(chunk.data))
    return sse_data(chunk.data)


def sse_data(value: Mapping[str, Any]) -> bytes:
    return b"data: %s\r\n\r\n" % json.dumps(value, separators=(",", ":")).encode()


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def token_text(token_id: int, token_bytes: bytes | None) -> str:
    """A token as OpenAI names it: its text, or its id where its bytes are not known."""
    if token_bytes is None:
        return token_name(token_id)
    return token_bytes.decode("utf-8", "replace")


def token_entry(token_id: int, token_bytes: bytes | None) -> dict[str, Any]:
    return {
        "token": token_text(token_id, token_bytes),
        "bytes": list(token_bytes) if token_bytes is not None else None,
    }


def _with_bytes(item: TokenLogprob) -> list[tuple[tuple[int, float], bytes | None]]:
    """The item's top alternatives, each with its bytes (None where not sent)."""
    top_bytes: tuple[bytes | None, ...] = item.top_token_bytes or (None,) * len(item.top_logprobs)
    return list(zip(item.top_logprobs, top_bytes, strict=True))


def _top_by_text(item: TokenLogprob) -> dict[str, float]:
    """Completions' top alternatives, a map by text: where two tokens read the same (parts of
    characters both show U+FFFD), the likelier one's logprob is kept."""
    top: dict[str, float] = {}
    for (token, logprob), token_bytes in _with_bytes(item):
        top.setdefault(token_text(token, token_bytes), logprob)
    return top


class _TextOffsets:
    """Where each logprob token starts in the output's text (completions' ``text_offset``),
    in characters: the tokens' bytes decoded in order, a character split across tokens counted
    once, at the token that completes it. Tokens without bytes have no offsets (all None)."""

    __slots__ = ("_chars", "_decoder", "_known", "offsets")

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0
        self._known = True
        self.offsets: list[int] = []

    def add(self, items: tuple[TokenLogprob, ...]) -> None:
        for item in items:
            if item.token_bytes is None:
                self._known = False
            self.offsets.append(self._chars)
            self._chars += len(self._decoder.decode(item.token_bytes or b""))

    def of(self, first: int, count: int) -> list[int] | None:
        return self.offsets[first : first + count] if self._known else None


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
