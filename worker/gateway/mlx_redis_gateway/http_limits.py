"""HTTP limits enforced before a request reaches a route, as nginx and Envoy enforce them.

Two layers, because uvicorn's httptools parser has no limit of its own on a request's head:

- ``guarded_protocol``: uvicorn's httptools protocol with a guard on the connection. A head
  (request line and headers) larger than ``max_header_bytes`` is a 431 and the connection is
  closed before the read that carried it past the limit is parsed (httptools joins a
  header's pieces by concatenation, so an unbounded header costs more than linear time on
  the event loop); a ``content-length`` over ``max_body_bytes`` is a 413 as soon as the head
  is parsed, before a route's task exists or a byte of the body is kept; a connection that
  has not sent a whole head within ``header_timeout`` seconds of opening (or of its
  request's first byte) is a 408 and closed (uvicorn's keep-alive timer only starts after a
  first response); a connection beyond ``max_connections`` open at once is a 503 and closed
  at once, before the process runs out of file descriptors; a connection serves at most
  ``max_requests_per_connection`` requests, then says ``connection: close``; a client address
  refused for size ``cooldown_after_refusals`` times within ``cooldown_seconds`` cools down
  (``address_cooldown``: its next connections are a 429, held unread, then reset). httptools was
  kept over h11 (which bounds a head itself) for its speed: see docs/gateway.md, "HTTP
  limits", for the figures.
- ``RequestLimits``: ASGI middleware for what needs the request's task: more than
  ``max_headers`` headers is a 431, a body that grows past ``max_body_bytes`` while read
  (chunked) a 413, and a body not whole within ``body_timeout`` seconds of the request's
  start a 408 (a client dripping its body cannot hold a connection and a route open for
  longer). Its two size refusals count toward the address's cool-down like the guard's own
  (the request's scope carries ``SIZE_REFUSED`` to the connection). ``read_json`` parses a
  body with a bound on its nesting (400, not a RecursionError's 500).

Every refusal is in the error shape of the API its path belongs to (``errors``), OpenAI's
where no path was read yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Final

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mlx_redis_gateway.address_cooldown import AddressCooldowns
from mlx_redis_gateway.connection_table import ConnectionTable, address_group
from mlx_redis_gateway.errors import ApiError
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits

log = structlog.get_logger(__name__)

_KIB: Final = 1024
_MIB: Final = 1024 * _KIB
# File descriptors kept free below the process's limit when the connection cap is derived
# from it: Redis connections (the pool holds up to 256), the key file, logs.
RESERVED_DESCRIPTORS: Final = 512
# Refusals are logged at most this often (per kind, with the count since the last line): a
# flood of refused connections must not become a flood of log lines.
REFUSAL_LOG_SECONDS: Final = 1.0


# What a job's bytes may become in a JSON body: a client that escapes non-ASCII text
# (Python's json and the SDKs built on it write a CJK character's 3 bytes as 6) doubles it.
JSON_EXPANSION: Final = 2
# A body's bytes that are no job's: field names, sampling settings, JSON's punctuation.
BODY_FRAMING: Final = 64 * _KIB


def body_limit(limits: Limits) -> int:
    """The largest body that could carry a job within ``limits``: a larger one is refused
    from its ``content-length``, before a byte of it is read (a 3.9 MiB body read whole,
    parsed and then refused by the job's limit cost the gateway a core at 80 a second)."""
    return JSON_EXPANSION * limits.max_message_bytes + BODY_FRAMING


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds on what one HTTP client can make the gateway hold or parse."""

    # The request line and all headers together (nginx: 4 buffers of 8 KiB).
    max_header_bytes: int = 32 * _KIB
    max_headers: int = 100
    # A request's body: what a job may hold, and JSON's framing of it (``body_limit``).
    max_body_bytes: int = field(default_factory=lambda: body_limit(DEFAULT_LIMITS))
    # Nesting of a JSON body (a response_format schema nests at most 32 levels of schema).
    max_json_depth: int = 128
    # Seconds from a connection's opening (or a request's first byte) to its whole head.
    header_timeout: float = 10.0
    # Seconds from a request's head to the last byte of its body: a deadline over the whole
    # body (nginx's client_body_timeout bounds only the gap between reads, which a client
    # sending a byte at a time never exceeds). 30 s carries the largest body at 140 KB/s.
    body_timeout: float = 30.0
    # Connections open at once; None: derived from the file-descriptor limit.
    max_connections: int | None = None
    # Connections one client address (an IPv6 /64) holds at once; 0: no bound (behind a
    # reverse proxy, which has one address). An SDK's pool opens tens; 256 leaves room for a
    # NAT of several.
    max_connections_per_address: int = 256
    # Seconds an idle keep-alive connection is kept when its last request had no valid API
    # key (those with one keep uvicorn's 75 s, longer than a load balancer's idle timeout).
    anonymous_keep_alive: float = 5.0
    max_requests_per_connection: int = 1000
    # An address refused for size (431, 413) this many times within ``cooldown_seconds``
    # cools down for ``cooldown_seconds`` (0: never). A client that hits a size limit by
    # mistake gets its error twice before the third refusal; none hits it three times in
    # 10 s but in a loop.
    cooldown_after_refusals: int = 3
    cooldown_seconds: float = 10.0
    # Connections of a cooling address held open (unread) at once; more are reset at accept.
    max_held_per_address: int = 16

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "max_body_bytes", "max_json_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.header_timeout <= 0:
            raise ValueError(f"--header-timeout must be positive, got {self.header_timeout}")
        if self.body_timeout <= 0:
            raise ValueError(f"--body-timeout must be positive, got {self.body_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.max_connections_per_address < 0:
            raise ValueError(
                "--max-connections-per-address must be 0 or more, "
                f"got {self.max_connections_per_address}"
            )
        if self.anonymous_keep_alive <= 0:
            raise ValueError(
                f"--anonymous-keep-alive must be positive, got {self.anonymous_keep_alive}"
            )
        if self.cooldown_after_refusals < 0:
            raise ValueError(
                f"--cooldown-after-refusals must be 0 or more, got {self.cooldown_after_refusals}"
            )
        if self.cooldown_seconds <= 0:
            raise ValueError(f"--cooldown-seconds must be positive, got {self.cooldown_seconds}")
        if self.max_held_per_address < 0:
            raise ValueError(
                f"--max-held-per-address must be 0 or more, got {self.max_held_per_address}"
            )
        if self.max_requests_per_connection < 1:
            raise ValueError(
                "--max-requests-per-connection must be at least 1, "
                f"got {self.max_requests_per_connection}"
            )

    def connection_cap(self) -> int:
        """``max_connections``, or what the descriptor limit leaves after the reserve."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return 10_000
        return max(64, min(10_000, soft - RESERVED_DESCRIPTORS))

    def room_from(self) -> int:
        """Open connections past which each new one closes an idle one for room: the cap
        less its last sixteenth (at least 16 connections, at most half the cap)."""
        cap = self.connection_cap()
        return cap - min(max(16, cap // 16), cap // 2)


DEFAULT_HTTP_LIMITS: Final = HttpLimits()


def error_body(message: str, kind: str, code: str, status: int = 0, path: str = "") -> bytes:
    """A refusal's body, in the shape of the API ``path`` belongs to (OpenAI's when the path
    is not known yet)."""
    return json.dumps(ApiError(status, message, kind, code=code).body_for(path)).encode()


class _RefusalLog:
    """Counts refusals and logs them at most once per ``REFUSAL_LOG_SECONDS`` per kind."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._logged_at: dict[str, float] = {}

    def note(self, code: str) -> None:
        self._counts[code] += 1
        now = time.monotonic()
        if now - self._logged_at.get(code, 0.0) >= REFUSAL_LOG_SECONDS:
            log.warning("http_refused", code=code, count=self._counts.pop(code))
            self._logged_at[code] = now


_refusals = _RefusalLog()


def note_refusal(code: str) -> None:
    """Count a refusal of ``code`` in the refusals' log (at most a line a second a kind)."""
    _refusals.note(code)


# What a refused connection is closed with: SO_LINGER on with a zero timeout makes close()
# send a reset and drop what is queued, with no FIN_WAIT or TIME_WAIT left behind.
_RESET_ON_CLOSE: Final = struct.pack("ii", 1, 0)
# Refusals that count toward an address's cool-down: those a client can repeat at no cost.
_SIZE_REFUSALS: Final = frozenset({"headers_too_large", "body_too_large"})
# Set in a request's ASGI scope by RequestLimits when it refused the request for size (too many
# headers, a chunked body past the limit): the connection's protocol counts it toward the
# address's cool-down once the answer is sent, as it does its own refusals.
SIZE_REFUSED: Final = "mlxw.size_refused"
# Set in a request's ASGI scope by the guard when its ``content-length`` is over the limit and
# it carries a key: RequestLimits refuses it (charging the key) without reading its body.
BODY_OVER_LIMIT: Final = "mlxw.body_over_limit"
# The headers a key may come in (``auth``): a request without one is refused at its head.
_KEY_HEADERS: Final = frozenset({b"authorization", b"x-api-key"})
# Set in a request's ASGI scope when a valid API key authenticated it: its connection keeps
# the long keep-alive timer.
KEYED: Final = "mlxw.keyed"


def guarded_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class with ``limits``' connection guards."""
    cap = limits.connection_cap()
    room_from = limits.room_from()
    cooldowns = AddressCooldowns(
        limits.cooldown_after_refusals, limits.cooldown_seconds, limits.max_held_per_address
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        # Bytes of the current head received so far; None once the head is complete.
        _head_bytes: int | None = 0
        # The current head's last bytes so far: its end may straddle two reads.
        _head_tail = b""
        _head_timer: asyncio.TimerHandle | None = None
        _served = 0
        # A declared body over the limit was refused: what the parser still finds in the
        # read is dropped.
        _body_refused = False
        # The cooling address this connection is held for (None: not held), and the timer
        # that resets it when the cool-down ends.
        _held_for: str | None = None
        _hold_timer: asyncio.TimerHandle | None = None
        # The address group this connection is counted under in the table (None: not counted).
        _group: str | None = None
        # Whether its last request had a valid key: it keeps its slot longer (closed for room
        # only when no idle connection without one is found).
        _keyed = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self.client is not None:
                group = address_group(self.client[0])
                if not table.add(group, self):
                    _refusals.note("too_many_connections_from_address")
                    self._reset()
                    return
                self._group = group
            if len(self.connections) > room_from:
                self._make_room()
            if len(self.connections) > cap:
                self._refuse(
                    503,
                    f"the gateway has {cap} connections open, its limit: retry later",
                    "server_error",
                    "too_many_connections",
                )
                return
            if self.client is not None:
                address = address_group(self.client[0])
                cooling = cooldowns.cooling(address)
                if cooling > 0:
                    self._turn_away(address, cooling)
                    return
            self._arm_head_timer()

        def _make_room(self) -> None:
            """Close the connection the table picks (an idle one of the address holding the
            most), so the newcomer does not find the gateway full."""
            victim = table.victim(
                lambda other: other is not self and not other._keyed and other._closable()
            ) or table.victim(lambda other: other is not self and other._closable())
            if victim is None:
                return
            _refusals.note("closed_for_room")
            victim._forget()
            # Out of the count now: the transport reports the loss only on a later turn.
            self.connections.discard(victim)
            victim.transport.close()

        def _closable(self) -> bool:
            """Whether closing this connection loses no answer: it serves no request whose
            head is whole (it is idle, or still sending a head)."""
            if self.transport.is_closing():
                return False
            return self.cycle is None or (self.cycle.response_complete and not self.pipeline)

        def _forget(self) -> None:
            if self._group is not None:
                table.remove(self._group, self)
                self._group = None

        def _turn_away(self, address: str, cooling: float) -> None:
            """A connection from a cooling address: a 429, then held unread until the
            cool-down ends (or reset at once when the address holds its share)."""
            _refusals.note("address_cooling_down")
            if not cooldowns.hold(address):
                self._reset()
                return
            self._held_for = address
            body = error_body(
                f"this address sent too many oversized requests: retry in {cooling:.0f} s",
                "rate_limit_error",
                "address_cooling_down",
            )
            head = (
                "HTTP/1.1 429 Too Many Requests\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\n"
                f"retry-after: {math.ceil(cooling)}\r\n"
                "connection: close\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
            self.transport.pause_reading()
            self._hold_timer = self.loop.call_later(cooling, self._end_hold)

        def _end_hold(self) -> None:
            """Reset the held connection once its address's cool-down has ended: a loop's
            timer may fire a little early (libuv counts whole milliseconds), and a client
            that reconnects at once must find the address served."""
            assert self._held_for is not None
            remaining = cooldowns.cooling(self._held_for)
            if remaining > 0:
                self._hold_timer = self.loop.call_later(remaining, self._end_hold)
                return
            self._reset()

        def _reset(self) -> None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._forget()
            if self._held_for is not None:
                cooldowns.release(self._held_for)
                self._held_for = None
                if self._hold_timer is not None:
                    self._hold_timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._held_for is not None:
                # uvloop starts reading after connection_made whatever it paused: pause
                # again, and what came is dropped unparsed.
                self.transport.pause_reading()
                return
            if self._head_bytes is not None:
                room = limits.max_header_bytes - self._head_bytes
                # A chunk that carries the head past the limit with no end of head inside
                # the limit is refused before the parser sees it: parsing a 256 KiB read of
                # one header costs the event loop about 0.3 ms, and a flood of such
                # connections would spend it on each.
                if len(data) > room and not _ends_head(self._head_tail + data[: max(room, 0)]):
                    self._refuse_oversized_head()
                    return
                self._head_bytes += len(data)
                self._head_tail = data[-3:] if len(data) >= 3 else (self._head_tail + data)[-3:]
            super().data_received(data)
            # Checked after the chunk was parsed too: a head that ended inside the limit may
            # be followed in the same chunk by the next pipelined request's oversized head.
            if (
                self._head_bytes is not None
                and self._head_bytes > limits.max_header_bytes
                and not self.transport.is_closing()
            ):
                self._refuse_oversized_head()

        def _refuse_oversized_head(self) -> None:
            self._refuse(
                431,
                f"the request's headers exceed {limits.max_header_bytes} bytes",
                "invalid_request_error",
                "headers_too_large",
            )

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_bytes is None:  # a keep-alive connection's next request
                self._head_bytes, self._head_tail = 0, b""
            if self._head_timer is None:
                self._arm_head_timer()

        def on_headers_complete(self) -> None:
            self._head_bytes = None
            self._cancel_head_timer()
            declared = _content_length(self.headers)
            answering = self.cycle is not None and not self.cycle.response_complete
            if declared is not None and declared > limits.max_body_bytes and not answering:
                # Refused before a route (and its task) exists and before the parser keeps
                # any of the body: a flood of such requests costs the gateway a head each.
                # (Behind a pipelined request still being answered, the body is refused as
                # it is read instead, so that answer is not cut.)
                self._body_refused = True
                if any(name in _KEY_HEADERS for name, _ in self.headers):
                    # A key pays for its refusals (RequestLimits charges it, then answers):
                    # the body is still never read.
                    self.flow.pause_reading()
                    self.scope[BODY_OVER_LIMIT] = True  # type: ignore[typeddict-unknown-key]
                    super().on_headers_complete()
                    return
                refusal = body_too_large(limits.max_body_bytes)
                path = self.url.decode("latin-1").partition("?")[0]
                self._refuse(413, refusal.message, refusal.type, "body_too_large", path)
                return
            super().on_headers_complete()
            self._served += 1
            if self._served >= limits.max_requests_per_connection and self.cycle is not None:
                self.cycle.keep_alive = False

        def on_body(self, body: bytes) -> None:
            if not self._body_refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._body_refused:
                super().on_message_complete()

        def _arm_head_timer(self) -> None:
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # A pipelined request's head is late while the one before is answered:
                # the answer is not cut; the next head gets its own full wait.
                self._arm_head_timer()
                return
            self._refuse(
                408,
                f"no complete request head within {limits.header_timeout:g} s",
                "invalid_request_error",
                "request_timeout",
            )

        def on_response_complete(self) -> None:
            scope = getattr(self, "scope", None)
            if scope is not None and scope.get(SIZE_REFUSED) and self.client is not None:
                cooldowns.refused(address_group(self.client[0]))
            self._keyed = bool(scope and scope.get(KEYED))
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None and not self._keyed:
                # No key: idle sockets cost a client nothing to keep, so they are not kept
                # long (the table closes them for room sooner still).
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = self.loop.call_later(
                    limits.anonymous_keep_alive, self.timeout_keep_alive_handler
                )

        def _refuse(self, status: int, message: str, kind: str, code: str, path: str = "") -> None:
            _refusals.note(code)
            if code in _SIZE_REFUSALS and self.client is not None:
                cooldowns.refused(address_group(self.client[0]))
            body = error_body(message, kind, code, status, path)
            head = (
                f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
                "content-type: application/json\r\n"
                f"content-length: {len(body)}\r\n"
                "connection: close\r\n\r\n"
            )
            self._cancel_head_timer()
            self.transport.write(head.encode() + body)
            self.transport.close()

    table: ConnectionTable[GuardedHttpToolsProtocol] = ConnectionTable(
        limits.max_connections_per_address
    )
    return GuardedHttpToolsProtocol


def _ends_head(data: bytes) -> bool:
    """Whether ``data`` holds the blank line that ends a request head (CRLF, or the bare LF
    a lenient parser takes)."""
    return b"\r\n\r\n" in data or b"\n\n" in data


class BodyTooLarge(ApiError):
    """A body that grew past the limit while it was read (no content-length said so)."""


def body_too_large(limit: int) -> ApiError:
    return BodyTooLarge(413, f"the request body exceeds {limit} bytes", code="body_too_large")


class RequestLimits:
    """ASGI middleware: header count and body size, checked before a route runs. A body
    refused for its size is first passed to ``on_body_refused`` (the gateway charges the
    request's key for it)."""

    def __init__(
        self,
        app: ASGIApp,
        limits: HttpLimits = DEFAULT_HTTP_LIMITS,
        on_body_refused: Callable[[Scope], Awaitable[None]] | None = None,
    ) -> None:
        self.app = app
        self.limits = limits
        self.on_body_refused = on_body_refused

    async def _body_refused(self, scope: Scope) -> ApiError:
        scope[SIZE_REFUSED] = True
        if self.on_body_refused is not None:
            await self.on_body_refused(scope)
        return body_too_large(self.limits.max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if len(headers) > self.limits.max_headers:
            scope[SIZE_REFUSED] = True
            await _send_error(
                send,
                scope["path"],
                ApiError(
                    431,
                    f"the request has {len(headers)} headers, more than {self.limits.max_headers}",
                    code="too_many_headers",
                ),
            )
            return
        if scope.get(BODY_OVER_LIMIT):
            await _send_error(send, scope["path"], await self._body_refused(scope))
            return
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout
        received, body_done, refused = 0, False, False

        async def bounded_receive() -> Message:
            nonlocal received, body_done, refused
            if body_done:  # what follows the body is the client leaving: no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                refused = True
                raise self._too_slow() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limits.max_body_bytes:
                    refused = True
                    raise await self._body_refused(scope)
                body_done = not message.get("more_body", False)
            return message

        async def closing_send(message: Message) -> None:
            # The rest of a refused body is not read: the connection cannot carry another
            # request, so the answer closes it.
            if refused and message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"connection", b"close")]}
            await send(message)

        await self.app(scope, bounded_receive, closing_send)

    def _too_slow(self) -> ApiError:
        return ApiError(
            408,
            f"the request body did not arrive whole within {self.limits.body_timeout:g} s",
            code="request_timeout",
        )


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_error(send: Send, path: str, error: ApiError) -> None:
    _refusals.note(error.code or str(error.status))
    body = json.dumps(error.body_for(path)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status_for(path),
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def read_json(body: bytes, max_depth: int) -> Any:
    """A request body's JSON, refused with a 400 when it is not JSON or nests deeper than
    ``max_depth``."""
    try:
        value = json.loads(body)
    except RecursionError as exc:
        raise _too_deep(max_depth) from exc
    except ValueError as exc:
        raise ApiError(400, "the request body is not valid JSON") from exc
    if _depth_exceeds(value, max_depth):
        raise _too_deep(max_depth)
    return value


def _too_deep(max_depth: int) -> ApiError:
    return ApiError(
        400, f"the request body nests deeper than {max_depth} levels", code="json_too_deep"
    )


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether ``value`` nests deeper than ``max_depth`` (iteratively: no recursion limit)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    children: Callable[[Any], Any]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = dict.values
        elif isinstance(item, list):
            children = iter
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children(item))
    return False
