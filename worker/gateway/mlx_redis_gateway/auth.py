"""Who may call the gateway: API keys as bearer tokens, and operator keys for the status page.

Without a key file every request passes (the CLI allows that only on a loopback address, or
with ``--no-auth``).
"""

from __future__ import annotations

import base64
from typing import Final

import structlog
from starlette.requests import Request

from mlx_redis_gateway.api_keys import ApiKey, KeyFile
from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.http_limits import KEYED

# A browser that gets this challenge asks for a user name and password itself, and sends them
# again with the page's own refreshes: the operator types the key as the password.
BASIC_CHALLENGE: Final = 'Basic realm="mlx-redis-worker status", charset="UTF-8"'


class Authenticator:
    def __init__(self, keys: KeyFile | None) -> None:
        self.keys = keys

    def api_key(self, request: Request) -> ApiKey | None:
        """The request's key: its bearer token (OpenAI's way), else its ``x-api-key`` header
        (Anthropic's); None when the gateway runs without keys; else a 401."""
        if self.keys is None:
            return None
        scheme, _, secret = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            secret = request.headers.get("x-api-key", "")
        if not secret.strip():
            raise ApiError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'.",
                code="missing_api_key",
            )
        key = self.keys.find(secret.strip())
        if key is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        structlog.contextvars.bind_contextvars(api_key=key.name)
        request.scope[KEYED] = True
        return key

    def operator(self, request: Request) -> None:
        """Pass an operator key (bearer token, or the password of HTTP Basic auth); 401 for
        none or a wrong one (with the Basic challenge), 403 for a key that is no operator's."""
        if self.keys is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        scheme, secret = scheme.lower(), credentials.strip()
        if scheme == "basic":
            try:
                secret = base64.b64decode(secret, validate=True).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                secret = ""
        key = self.keys.find(secret) if scheme in ("basic", "bearer") and secret else None
        if key is None:
            raise ApiError(
                401,
                "The status page needs an operator API key (as a bearer token, or as the "
                "password of HTTP Basic auth).",
                code="invalid_api_key",
                challenge=BASIC_CHALLENGE,
            )
        if not key.operator:
            raise ApiError(
                403,
                f"API key {key.name!r} is not an operator key (operator = true in the key file).",
                "permission_error",
                code="not_an_operator",
            )
