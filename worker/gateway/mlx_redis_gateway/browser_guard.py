"""What keeps a gateway safe from the web pages its operator visits.

A gateway without API keys on loopback trusts whoever reaches it, and a page in the
operator's browser can: by DNS rebinding (its own name resolved to 127.0.0.1, so its scripts
read the answers) and by simple cross-origin POSTs (a form, or ``fetch`` with ``text/plain``,
which no preflight stops). So:

- ``BrowserGuard`` answers a request whose ``Host`` is not allowed with a 400 before any
  route runs: loopback names (``localhost``, ``127.0.0.1``, ``::1``) and the ``--allowed-host``
  names, checked when the gateway has no keys or when ``--allowed-host`` names any (with keys,
  a rebinding page has none to send, and a gateway behind a balancer answers to its names).
  Every answer says ``X-Content-Type-Options: nosniff`` and ``X-Frame-Options: DENY``.
- ``require_json`` refuses a body that does not say ``Content-Type: application/json`` with a
  415 (what a browser sends without a preflight never does).
- ``STATUS_PAGE_CSP``: the status page's Content-Security-Policy; its one script by hash.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Final

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_redis_gateway.errors import ApiError

LOOPBACK_HOSTS: Final = ("localhost", "127.0.0.1", "::1")
ANY_HOST: Final = "*"
_SECURITY_HEADERS: Final = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY")]


def script_csp(script: str) -> str:
    """A policy for a page whose only script is ``script`` (inline) and whose styles are
    inline: nothing else is loaded, framed, or sent anywhere but this origin."""
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    return (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


def host_name(header: str) -> str:
    """The name in a ``Host`` header: no port, no brackets, lower case, no trailing dot."""
    header = header.strip().lower()
    if header.startswith("["):  # [::1]:8000
        return header[1:].partition("]")[0]
    name, colon, port = header.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        header = name
    return header.rstrip(".")


class BrowserGuard:
    """ASGI middleware: the Host allowlist and the security headers of every answer."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...] | None) -> None:
        """``allowed_hosts``: None checks no Host; ``*`` among them allows any."""
        self.app = app
        self.allowed = (
            None
            if allowed_hosts is None or ANY_HOST in allowed_hosts
            else frozenset(host_name(host) for host in (*LOOPBACK_HOSTS, *allowed_hosts))
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_SECURITY_HEADERS]}
            await send(message)

        if self.allowed is not None:
            host = next((value for name, value in scope["headers"] if name == b"host"), None)
            # A request without Host (HTTP/1.0) comes from no browser: only browsers are kept out.
            name = host_name(host.decode("latin-1")) if host is not None else None
            if name is not None and name not in self.allowed:
                error = ApiError(
                    400,
                    f"the Host {name!r} is not one this gateway answers to "
                    "(mlx-worker gateway --allowed-host NAME)",
                    code="invalid_host",
                )
                body = json.dumps(error.body_for(scope["path"])).encode()
                await secured(
                    {
                        "type": "http.response.start",
                        "status": 400,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await secured({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, secured)


def require_json(request: Request) -> None:
    """415 unless the request's body says it is JSON."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            415,
            "the request body must be sent with Content-Type: application/json, "
            f"got {media_type or 'none'!r}",
            param="Content-Type",
            code="unsupported_media_type",
        )
