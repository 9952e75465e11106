"""A quiet stream's keep-alive, as the openai SDK reads it: the gateway's SSE answer (the real
``event_stream``, served by Starlette) with keep-alives between its messages, decoded by the
SDK's own SSE decoder, holds only the messages. A keep-alive ending in a blank line (the SSE
library's default) hands the SDK an empty event after any ``id:``, which it cannot parse."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from anthropic._streaming import SSEDecoder as AnthropicSSEDecoder
from openai._streaming import SSEDecoder
from sse_starlette import ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from mlx_redis_gateway import gateway
from mlx_redis_gateway.shaping import DONE_MESSAGE

MESSAGES = [b'id: %d\r\ndata: {"n": %d}\r\n\r\n' % (n, n) for n in range(2)]


def _served(pings: float, messages: list[bytes] = MESSAGES, anthropic: bool = False) -> bytes:
    """The bytes of an answer whose two messages are ``pings`` keep-alive periods apart."""

    async def sent() -> AsyncIterator[bytes]:
        yield messages[0]
        await asyncio.sleep(pings * gateway.PING_SECONDS)
        yield messages[1]
        if not anthropic:
            yield DONE_MESSAGE

    async def answer(request: Request) -> Response:
        return gateway.event_stream(sent(), "r", anthropic=anthropic)

    with TestClient(Starlette(routes=[Route("/", answer)])) as client:
        return client.get("/").content


def _events(raw: bytes) -> list[str]:
    return [event.data for event in SSEDecoder().iter_bytes(iter([raw]))]


def test_keep_alives_between_messages_are_invisible_to_the_openai_sdk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gateway, "PING_SECONDS", 0.2)
    raw = _served(pings=3.5)
    assert raw.count(b": ping\r\n") >= 2  # the keep-alives were sent, between the messages
    events = _events(raw)
    assert events == ['{"n": 0}', '{"n": 1}', "[DONE]"]
    assert [json.loads(data)["n"] for data in events[:2]] == [0, 1]


def test_a_keep_alive_ending_in_a_blank_line_is_an_empty_event_to_the_sdk() -> None:
    """Why the keep-alive has no blank line: the library's default one is an event."""
    default = ServerSentEvent(comment="ping").encode()
    assert default.endswith(b"\r\n\r\n")
    assert _events(MESSAGES[0] + default + MESSAGES[1]) == ['{"n": 0}', "", '{"n": 1}']
    assert _events(MESSAGES[0] + gateway.KeepAlive().encode() + MESSAGES[1]) == [
        '{"n": 0}',
        '{"n": 1}',
    ]


def test_a_quiet_messages_stream_gets_anthropics_ping_events_without_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Messages stream's keep-alive is Anthropic's own ``ping`` event (its SDK skips it by
    name), carrying no id: a client that resumes after it resumes after the last real one."""
    monkeypatch.setattr(gateway, "PING_SECONDS", 0.2)
    named = [b'id: %d\r\nevent: n\r\ndata: {"n": %d}\r\n\r\n' % (n, n) for n in range(2)]
    decoded = list(AnthropicSSEDecoder().iter_bytes(iter([_served(3.5, named, anthropic=True)])))
    assert [event.event for event in decoded if event.event != "ping"] == ["n", "n"]
    pings = [event for event in decoded if event.event == "ping"]
    assert len(pings) >= 2 and all(json.loads(ping.data) == {"type": "ping"} for ping in pings)
    assert all(ping.id == "0" for ping in pings)  # the last id seen stays the real message's
