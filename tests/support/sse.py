"""A raw HTTP client for the gateway, for what the ``openai`` package hides: each SSE message
with its ``id:``, a TCP connection dropped mid-stream (or before the answer), the headers."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True, slots=True)
class SseMessage:
    """One server-sent event: its ``id:`` (None when it has none), its ``data:`` and its
    ``event:`` name (None when it has none: OpenAI's chunks)."""

    id: int | None
    data: str
    event: str | None = None

    @property
    def is_done(self) -> bool:
        return self.data == "[DONE]"

    def json(self) -> dict[str, Any]:
        value = json.loads(self.data)
        assert isinstance(value, dict), self.data
        return value

    @property
    def content(self) -> str:
        """The text this chunk adds: a chat chunk's delta content, a text chunk's text."""
        if self.is_done:
            return ""
        choices = self.json().get("choices") or []
        if not choices:
            return ""
        choice = choices[0]
        if "delta" in choice:
            return str(choice["delta"].get("content") or "")
        return str(choice.get("text") or "")

    @property
    def finish_reason(self) -> str | None:
        if self.is_done:
            return None
        choices = self.json().get("choices") or []
        return choices[0].get("finish_reason") if choices else None


class RawRequest:
    """One HTTP request on a connection of its own. ``send`` writes it; ``response`` reads the
    status line and headers; ``messages`` reads the SSE body one message at a time; ``drop``
    closes the TCP connection (FIN) whatever state the exchange is in."""

    def __init__(
        self,
        url: str,
        method: str,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None, url
        self.connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
        self.method = method
        self.path = path
        self.body = json.dumps(body).encode() if body is not None else None
        self.headers = dict(headers or {})
        if self.body is not None:
            self.headers.setdefault("Content-Type", "application/json")
        self._socket: socket.socket | None = None
        self._response: http.client.HTTPResponse | None = None

    def send(self) -> RawRequest:
        self.connection.connect()
        self._socket = self.connection.sock
        self.connection.request(self.method, self.path, body=self.body, headers=self.headers)
        return self

    def response(self) -> http.client.HTTPResponse:
        if self._socket is None:
            self.send()
        if self._response is None:
            self._response = self.connection.getresponse()
        return self._response

    def json(self) -> dict[str, Any]:
        """The whole body, decoded (a non-streaming answer or an error)."""
        value = json.loads(self.response().read())
        assert isinstance(value, dict), value
        return value

    def messages(self) -> Iterator[SseMessage]:
        """The SSE messages of the body, as they arrive (comment lines, OpenAI's keep-alive,
        skipped)."""
        response = self.response()
        event_id: int | None = None
        event: str | None = None
        data: list[str] = []
        while True:
            raw = response.readline()
            if not raw:
                return
            line = raw.decode().rstrip("\r\n")
            if line == "":
                if data:
                    yield SseMessage(event_id, "\n".join(data), event)
                event_id, event, data = None, None, []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                value = value.removeprefix(" ")
                if name == "id":
                    event_id = int(value)
                elif name == "event":
                    event = value
                elif name == "data":
                    data.append(value)

    def drop(self) -> None:
        """Close the TCP connection now, as a client that went away does."""
        if self._socket is not None:
            with contextlib.suppress(OSError):  # the server may have closed it already
                self._socket.shutdown(socket.SHUT_RDWR)
            self._socket.close()
        if self._response is not None:
            self._response.close()
        self.connection.close()

    def __enter__(self) -> RawRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()


def stream_chat(
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
) -> RawRequest:
    """A started ``POST /v1/chat/completions`` with ``stream: true``; its response read (the
    gateway answered 200 and the job is queued)."""
    request = RawRequest(
        url, "POST", "/v1/chat/completions", body={**body, "stream": True}, headers=headers
    )
    status = request.response().status
    assert status == 200, f"{status}: {request.response().read()!r}"
    return request


ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "none"}


def count_tokens(url: str, body: Mapping[str, Any]) -> int:
    """``POST /v1/messages/count_tokens``'s ``input_tokens`` (``max_tokens`` and ``stream``
    left out of the body, as that route takes none)."""
    body = {name: value for name, value in body.items() if name not in ("max_tokens", "stream")}
    path = "/v1/messages/count_tokens"
    with RawRequest(url, "POST", path, body=body, headers=ANTHROPIC_HEADERS) as post:
        assert post.response().status == 200, post.response().read()
        count = post.json()["input_tokens"]
        assert isinstance(count, int)
        return count


def anthropic_message(url: str, body: Mapping[str, Any], timeout: float = 300) -> dict[str, Any]:
    """An Anthropic Messages answer read as an agent does without the SDK: the JSON body, or
    (``stream`` true, the default) the message its events build: blocks from
    ``content_block_start``, their text, thought and ``input_json_delta`` pieces joined, the
    stop reason and usage from ``message_delta``."""
    body = {"stream": True, **body}
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "none"}
    with RawRequest(
        url, "POST", "/v1/messages", body=body, headers=headers, timeout=timeout
    ) as post:
        assert post.response().status == 200, post.response().read()
        if not body["stream"]:
            return post.json()
        message: dict[str, Any] = {}
        pieces: dict[int, str] = {}
        for sse in post.messages():
            event = sse.json()
            assert event["type"] == sse.event, sse
            if event["type"] == "message_start":
                message = event["message"]
            elif event["type"] == "content_block_start":
                message["content"].append(event["content_block"])
            elif event["type"] == "content_block_delta":
                delta, index = event["delta"], event["index"]
                if delta["type"] == "input_json_delta":
                    pieces[index] = pieces.get(index, "") + delta["partial_json"]
                else:  # text_delta, thinking_delta: more of the block's text or thought
                    field = delta["type"].removesuffix("_delta")
                    message["content"][index][field] += delta[field]
            elif event["type"] == "content_block_stop" and event["index"] in pieces:
                message["content"][event["index"]]["input"] = json.loads(pieces[event["index"]])
            elif event["type"] == "message_delta":
                message |= event["delta"]
                message["usage"] = event["usage"]
        return message
