"""``POST /v1/responses``: OpenAI's Responses API, over the same chat jobs.

A body's ``instructions``, ``input`` and function ``tools`` become a chat request
(:mod:`mlx_redis_gateway.responses_items`), read by the chat parser (one set of rules and
refusals); with ``previous_response_id``, the stored conversation it names comes before the
input (``response_store``). The answer is a Responses object, or its stream of typed events
(``response.created`` … ``response.output_text.delta`` or
``response.function_call_arguments.delta`` … ``response.completed``). ``conversation``,
``background`` and stored prompts are a 400 naming the field. The answer's text and calls come
through the chat shaper, so a job re-run after a worker crash streams on as a chat stream does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from mlx_redis_gateway.errors import ApiError, bad_request
from mlx_redis_gateway.openai_api import CompletionRequest, parse_request
from mlx_redis_gateway.request_counts import DEFAULT_COUNTS, RequestCounts, check_responses
from mlx_redis_gateway.responses_items import (
    chat_tool_choice,
    chat_tools,
    chat_turns,
    echoed_tools,
    function_call_item,
    input_items,
    output_items,
)
from mlx_redis_gateway.shaping import Chunk, Shaper
from mlx_redis_protocol.identifiers import is_valid_id, new_request_id
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import DoneEvent, Event, ToolCall, Usage

# Fields that need what this gateway does not keep or run: a 400 naming them when set.
_UNSUPPORTED: Final = {
    "conversation": "conversations are not supported (previous_response_id chains responses)",
    "background": "background responses are not supported",
    "prompt": "stored prompts are not supported",
}
LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A Responses body read: its chat job, the fields its answer echoes, whether it is to be
    stored, and its input as the items a stored response lists."""

    accepted: CompletionRequest
    echoed: dict[str, Any]
    store: bool
    input_items: list[dict[str, Any]]


def previous_response_id(body: object) -> str | None:
    """The stored response a body continues from (checked: a string), or None."""
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if previous is not None and not isinstance(previous, str):
        raise bad_request("previous_response_id must be a string", param="previous_response_id")
    return previous


def previous_not_found(response_id: str) -> ApiError:
    """OpenAI's answer to a ``previous_response_id`` it does not have (or no longer)."""
    return ApiError(
        400,
        # At most an id's length of what the caller sent is said back.
        f"Previous response with id {response_id[:128]!r} not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def is_response_id(value: str) -> bool:
    return value.startswith("resp_") and is_valid_id(value)


def parse_responses_request(
    body: object,
    *,
    limits: Limits,
    user_key: str | None = None,
    context: Sequence[dict[str, Any]] = (),
    counts: RequestCounts = DEFAULT_COUNTS,
) -> ResponsesRequest:
    """The chat request a Responses body stands for (after ``context``, the items of the
    stored conversation it continues), and the fields its answer echoes; ``counts``: how many
    input items, parts and tools it may hold."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_responses(body, counts)
    for name, message in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], False):
            raise bad_request(message, param=name)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("store must be a boolean", param="store")
    chat: dict[str, Any] = {"messages": _messages(body, context)}
    for name in ("model", "temperature", "top_p", "user", "stream", "metadata", "priority"):
        if name in body:
            chat[name] = body[name]
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        chat["tool_choice"] = chat_tool_choice(body.get("tool_choice"))
    if "parallel_tool_calls" in body:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if _wants_logprobs(body):
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    try:
        accepted = parse_request("chat", chat, limits=limits, user_key=user_key, counts=counts)
    except ApiError as error:
        if error.param == "max_tokens":
            error.param = "max_output_tokens"
            error.message = error.message.replace("max_tokens", "max_output_tokens")
        raise
    # A Responses id, as the job's (it is the answer's id, and the key of its log).
    job = _replace_id(accepted, f"resp_{new_request_id()}")
    echoed = {
        "instructions": body.get("instructions")
        if isinstance(body.get("instructions"), str)
        else None,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "temperature": chat.get("temperature"),
        "top_p": chat.get("top_p"),
        "max_output_tokens": chat.get("max_tokens"),
        "user": chat.get("user"),
        "text": {"format": _echoed_format(body.get("text"))},
        "top_logprobs": chat.get("top_logprobs"),
        "tools": echoed_tools(tools),
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "store": store is not False,
        "previous_response_id": previous_response_id(body),
    }
    return ResponsesRequest(job, echoed, store is not False, input_items(body["input"]))


def _wants_logprobs(body: Mapping[str, Any]) -> bool:
    """Whether the answer carries its tokens' logprobs: ``include`` names them, or
    ``top_logprobs`` asks for alternatives."""
    include = body.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(item, str) for item in include)
    ):
        raise bad_request("include must be an array of strings", param="include")
    return LOGPROBS_INCLUDE in (include or []) or body.get("top_logprobs") is not None


def _replace_id(accepted: CompletionRequest, request_id: str) -> CompletionRequest:
    return replace(accepted, job=replace(accepted.job, request_id=request_id))


def _messages(body: Mapping[str, Any], context: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``instructions`` as a system turn, then the stored conversation's turns (not its
    instructions, as OpenAI), then ``input``'s, as chat messages."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    if context:
        messages += chat_turns(list(context))
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        messages += chat_turns(value)
    else:
        raise bad_request("input must be a string or a non-empty array of messages", param="input")
    return messages


def _text_format(text: object) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format``."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", param="text.format")
    kind = fmt.get("type", "text")
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request(
        f"text.format type {kind!r} is not supported (text, json_object, json_schema)",
        param="text.format",
    )


def _echoed_format(text: object) -> dict[str, Any]:
    fmt = text.get("format") if isinstance(text, dict) else None
    return dict(fmt) if isinstance(fmt, dict) else {"type": "text"}


class ResponseEvents:
    """A request's protocol events → the Responses API's stream events, each an SSE message
    with a ``sequence_number`` of its own. Its text and call pieces come through a chat
    ``Shaper``. Output items open as they begin (the text's ``message``, then a
    ``function_call`` per call) and close when the next one opens or the answer ends."""

    def __init__(
        self,
        request_id: str,
        shaper: Shaper,
        echoed: Mapping[str, Any],
        created: float,
        *,
        hold_final: bool = False,
    ) -> None:
        """``hold_final``: the last message (``response.completed`` or
        ``response.incomplete``) waits for ``final_message()``, so the response is stored
        before a client can read its id and continue from it."""
        self.request_id = request_id
        self.hold_final = hold_final
        self.final: dict[str, Any] | None = None  # the finished response, once done
        self.shaper = shaper
        self.echoed = echoed
        self.created = created
        self.base_id = request_id.removeprefix("resp_")
        self.item_id = f"msg_{self.base_id}"
        self.sequence = 0
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # the text's tokens', when asked for
        self.items = 0  # output items opened so far
        self.message_at: int | None = None  # the message item's output_index, once open
        self.message_closed = False
        self.open_call: tuple[int, ToolCall] | None = None  # (call index, call so far)

    def opening(self) -> bytes:
        response = self.response("in_progress")
        return b"".join(
            [
                self._message("response.created", response=response),
                self._message("response.in_progress", response=response),
            ]
        )

    def feed(self, event: Event) -> bytes:
        messages = []
        for chunk in self.shaper.feed(event):
            messages.append(self._from_chunk(chunk))
        return b"".join(messages)

    def failed(self, error: ApiError) -> bytes:
        """The last message of a request that failed: its response, with the error."""
        response = self.response("failed")
        response["error"] = {"code": error.code or error.type, "message": error.message}
        return self._message("response.failed", response=response)

    def _from_chunk(self, chunk: Chunk) -> bytes:
        if self.shaper.error is not None:
            return self.failed(self.shaper.error)
        out = []
        for choice in chunk.data.get("choices", []):
            delta = choice.get("delta", {})
            text = delta.get("content")
            if text:
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                out.append(self._text_delta(text, logprobs))
            for piece in delta.get("tool_calls") or ():
                out.append(self._call_piece(piece))
        done = self.shaper.done
        if (
            done is not None
            and chunk.data.get("choices")
            and chunk.data["choices"][0].get("finish_reason")
        ):
            out.append(self._closing(done))
        return b"".join(out)

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        opened = self._open_message() if self.message_at is None else b""
        self.text.append(text)
        self.logprobs += logprobs
        delta = self._message(
            "response.output_text.delta", **self._where(), delta=text, logprobs=logprobs
        )
        return opened + delta

    def _open_message(self) -> bytes:
        self.message_at, self.items = self.items, self.items + 1
        return b"".join(
            [
                self._message(
                    "response.output_item.added",
                    output_index=self.message_at,
                    item=self._item("in_progress", []),
                ),
                self._message(
                    "response.content_part.added", **self._where(), part=_text_part("", [])
                ),
            ]
        )

    def _call_piece(self, piece: Mapping[str, Any]) -> bytes:
        """A chat ``delta.tool_calls`` piece: a call's first one opens its item, the others
        are its arguments' text."""
        function = piece.get("function") or {}
        out = []
        if piece.get("id") is not None:
            out.append(self._close_call())
            out.append(self._close_message("completed"))
            call = ToolCall(piece["id"], function.get("name") or "", "")
            self.open_call = (piece["index"], call)
            self.items += 1
            out.append(
                self._message(
                    "response.output_item.added",
                    output_index=self.items - 1,
                    item=function_call_item(self.base_id, piece["index"], call, "in_progress"),
                )
            )
        arguments = function.get("arguments") or ""
        if arguments and self.open_call is not None:
            index, call = self.open_call
            self.open_call = (index, ToolCall(call.id, call.name, call.arguments + arguments))
            out.append(
                self._message(
                    "response.function_call_arguments.delta",
                    item_id=f"fc_{self.base_id}_{index}",
                    output_index=self.items - 1,
                    delta=arguments,
                )
            )
        return b"".join(out)

    def _close_call(self, status: str = "completed") -> bytes:
        if self.open_call is None:
            return b""
        index, call = self.open_call
        self.open_call = None
        item = function_call_item(self.base_id, index, call, status)
        return b"".join(
            [
                self._message(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=self.items - 1,
                    name=call.name,
                    arguments=call.arguments,
                ),
                self._message("response.output_item.done", output_index=self.items - 1, item=item),
            ]
        )

    def _close_message(self, status: str) -> bytes:
        if self.message_at is None or self.message_closed:
            return b""
        self.message_closed = True
        text = "".join(self.text)
        part = _text_part(text, self.logprobs)
        where = self._where()
        return b"".join(
            [
                self._message(
                    "response.output_text.done", **where, text=text, logprobs=self.logprobs
                ),
                self._message("response.content_part.done", **where, part=part),
                self._message(
                    "response.output_item.done",
                    output_index=self.message_at,
                    item=self._item(status, [part]),
                ),
            ]
        )

    def _closing(self, done: DoneEvent) -> bytes:
        status = _status(done)
        made = {call.id for call in done.tool_calls}
        # A call still open at the end is whole unless the answer was cut inside it.
        open_id = self.open_call[1].id if self.open_call is not None else None
        out = [self._close_call("completed" if open_id in made else "incomplete")]
        if self.message_at is None and not done.tool_calls:
            out.append(self._open_message())  # an answer without text still has its message
        out.append(self._close_message("completed" if status == "completed" else "incomplete"))
        self.final = self.response(status, done, self.logprobs)
        if not self.hold_final:
            out.append(self.final_message())
        return b"".join(out)

    def final_message(self) -> bytes:
        """The message that ends a finished response's stream."""
        assert self.final is not None
        return self._message(f"response.{self.final['status']}", response=self.final)

    def response(
        self,
        status: str,
        done: DoneEvent | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The response object, as it stands (with its output and usage once ``done``)."""
        output: list[dict[str, Any]] = []
        if done is not None:
            item_status = "completed" if status == "completed" else "incomplete"
            message = self._item(item_status, [_text_part(done.output_text, logprobs or [])])
            output = output_items(message, self.base_id, done)
        return response_object(
            self.request_id,
            self.created,
            self.shaper.shape.model,
            status,
            output,
            self.echoed,
            done,
        )

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.message_at, "content_index": 0}

    def _message(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: %s\r\ndata: %s\r\n\r\n" % (
            kind.encode(),
            json.dumps(data, separators=(",", ":")).encode(),
        )


def response_object(
    request_id: str,
    created: float,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    echoed: Mapping[str, Any],
    done: DoneEvent | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": _incomplete_details(status, done),
        "model": model,
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "store": False,
        "usage": _usage(done.usage) if done is not None else None,
        **echoed,
    }


def completed_response(shaper: Shaper, echoed: Mapping[str, Any], created: float) -> dict[str, Any]:
    """The non-streamed answer of a finished request."""
    if shaper.error is not None:
        raise shaper.error
    done = shaper.done
    assert done is not None
    events = ResponseEvents(shaper.request_id, shaper, echoed, created)
    logprobs = (shaper.completion()["choices"][0]["logprobs"] or {}).get("content") or []
    return events.response(_status(done), done, logprobs)


def _status(done: DoneEvent) -> str:
    """``completed`` for an answer that ended on its own (EOS, a stop), else ``incomplete``
    (cut by ``max_output_tokens``, aborted)."""
    return "completed" if done.finish_reason == "stop" else "incomplete"


def _incomplete_details(status: str, done: DoneEvent | None) -> dict[str, Any] | None:
    if status != "incomplete" or done is None:
        return None
    return {"reason": "max_output_tokens" if done.finish_reason == "length" else None}


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
