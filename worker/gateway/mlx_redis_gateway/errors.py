"""OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with its status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Protocol error codes of a request's terminal `error` event → HTTP status and OpenAI type.
_EVENT_ERRORS: dict[str, tuple[int, str]] = {
    "unknown_model": (404, "invalid_request_error"),
    "already_finished": (409, "invalid_request_error"),
    "invalid_job": (400, "invalid_request_error"),
    "dead_lettered": (500, "server_error"),
    "engine_error": (500, "server_error"),
    "internal": (500, "server_error"),
}


@dataclass(eq=False)  # not frozen: raising sets __cause__ and __traceback__ on it
class ApiError(Exception):
    """A request the gateway answers with an OpenAI error body instead of a completion."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None  # seconds, for 429 (the Retry-After header)
    # For 401 on a page a browser loads: the WWW-Authenticate challenge (it then asks for a
    # key as the Basic password).
    challenge: str | None = None
    # More headers of the answer (a 429's ``x-ratelimit-*``).
    extra_headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after + 0.5)))
        if self.challenge is not None:
            headers["WWW-Authenticate"] = self.challenge
        headers.update(self.extra_headers or {})
        return headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_error_event(code: str, message: str) -> ApiError:
    """The HTTP answer for a request that ended with an `error` event of ``code``."""
    status, kind = _EVENT_ERRORS.get(code, (500, "server_error"))
    if code == "unknown_model":
        return ApiError(status, message, kind, param="model", code="model_not_found")
    return ApiError(status, message, kind, code=code)
