"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the same chat jobs.

A body's ``instructions`` and ``input`` (a string, or a list of messages with text parts)
become a chat request, read by the chat parser (one set of rules and refusals); the answer is
a Responses object, or its stream of typed events (``response.created`` …
``response.output_text.delta`` … ``response.completed``). Nothing is stored beyond the job's
log: ``store`` is ignored, ``previous_response_id`` and anything else that needs a stored
response (or a tool) is a 400 naming it. The answer's text comes through the chat shaper, so
a job re-run after a worker crash streams on as a chat stream does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final

from mlx_redis_gateway.errors import ApiError, bad_request
from mlx_redis_gateway.openai_api import CompletionRequest, parse_request
from mlx_redis_gateway.shaping import Chunk, Shaper
from mlx_redis_protocol.identifiers import new_request_id
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import DoneEvent, Event, Usage

# Fields that need what this gateway does not keep or run: a 400 naming them when set.
_UNSUPPORTED: Final = {
    "previous_response_id": "previous_response_id needs stored responses (this API is stateless)",
    "conversation": "conversation needs stored responses (this API is stateless)",
    "tools": "tools are not supported by /v1/responses yet",
    "background": "background responses are not supported",
    "prompt": "stored prompts are not supported",
}
_ROLES: Final = ("system", "developer", "user", "assistant")
LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"
_TEXT_PARTS: Final = ("input_text", "output_text", "text")


def parse_responses_request(
    body: object, *, limits: Limits, user_key: str | None = None
) -> tuple[CompletionRequest, dict[str, Any]]:
    """The chat request a Responses body stands for, and the fields its answer echoes."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name, message in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], False):
            raise bad_request(message, param=name)
    chat: dict[str, Any] = {"messages": _messages(body)}
    for name in ("model", "temperature", "top_p", "user", "stream", "metadata"):
        if name in body:
            chat[name] = body[name]
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
        accepted = parse_request("chat", chat, limits=limits, user_key=user_key)
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
    }
    return job, echoed


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


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` as a system turn, then ``input``'s turns, as chat messages."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    value = body.get("input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        messages += [_input_item(item, index) for index, item in enumerate(value)]
    else:
        raise bad_request("input must be a string or a non-empty array of messages", param="input")
    return messages


def _input_item(item: object, index: int) -> dict[str, Any]:
    param = f"input[{index}]"
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else None
        raise bad_request(
            f"{param} must be a message (items of type {kind!r} are not supported)", param=param
        )
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(_ROLES)}", param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(
            f"{param}.content must be a string or an array of text parts", param=f"{param}.content"
        )
    texts = []
    for part in content:
        if not (
            isinstance(part, dict)
            and part.get("type") in _TEXT_PARTS
            and isinstance(part.get("text"), str)
        ):
            raise bad_request(f"{param}.content may hold only text parts", param=f"{param}.content")
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


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
    with a ``sequence_number`` of its own. Its text comes through a chat ``Shaper``."""

    def __init__(
        self, request_id: str, shaper: Shaper, echoed: Mapping[str, Any], created: float
    ) -> None:
        self.request_id = request_id
        self.shaper = shaper
        self.echoed = echoed
        self.created = created
        self.item_id = f"msg_{request_id.removeprefix('resp_')}"
        self.sequence = 0
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []  # the text's tokens', when asked for

    def opening(self) -> bytes:
        response = self.response("in_progress")
        item = self._item("in_progress", [])
        part = _text_part("", [])
        return b"".join(
            [
                self._message("response.created", response=response),
                self._message("response.in_progress", response=response),
                self._message("response.output_item.added", output_index=0, item=item),
                self._message("response.content_part.added", **self._where(), part=part),
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
            delta = choice.get("delta", {}).get("content")
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if delta or logprobs:
                self.text.append(delta or "")
                self.logprobs += logprobs
                out.append(
                    self._message(
                        "response.output_text.delta",
                        **self._where(),
                        delta=delta or "",
                        logprobs=logprobs,
                    )
                )
        done = self.shaper.done
        if (
            done is not None
            and chunk.data.get("choices")
            and chunk.data["choices"][0].get("finish_reason")
        ):
            out.append(self._closing(done))
        return b"".join(out)

    def _closing(self, done: DoneEvent) -> bytes:
        text = "".join(self.text)
        part = _text_part(text, self.logprobs)
        status = _status(done)
        item = self._item("completed" if status == "completed" else "incomplete", [part])
        response = self.response(status, done, self.logprobs)
        return b"".join(
            [
                self._message(
                    "response.output_text.done", **self._where(), text=text, logprobs=self.logprobs
                ),
                self._message("response.content_part.done", **self._where(), part=part),
                self._message("response.output_item.done", output_index=0, item=item),
                self._message(f"response.{status}", response=response),
            ]
        )

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
            output = [self._item(item_status, [_text_part(done.output_text, logprobs or [])])]
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
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

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
