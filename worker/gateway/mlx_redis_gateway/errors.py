"""The gateway's errors, in the shape of the API a request speaks: OpenAI's
``{"error": {"message", "type", "param", "code"}}``, or, on Anthropic's routes
(``/v1/messages``), ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's
type for the status (and its 529 where OpenAI's routes answer 503)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

# Protocol error codes of a request's terminal `error` event → HTTP status and OpenAI type.
_EVENT_ERRORS: dict[str, tuple[int, str]] = {
    "unknown_model": (404, "invalid_request_error"),
    "already_finished": (409, "invalid_request_error"),
    "invalid_job": (400, "invalid_request_error"),
    "dead_lettered": (500, "server_error"),
    "engine_error": (500, "server_error"),
    "internal": (500, "server_error"),
}

# Where Anthropic's Messages API is served: an error on these paths is in its shape.
ANTHROPIC_ROUTES: Final = "/v1/messages"
# Anthropic's error type for each status it documents; any other 4xx is an
# invalid_request_error, any other 5xx an api_error.
_ANTHROPIC_TYPES: Final = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Anthropic says "overloaded" with a 529 where OpenAI's routes answer 503 (the queue is
# unreachable, the gateway is at its connection limit): its SDKs retry either.
OVERLOADED: Final = 529


def speaks_anthropic(path: str) -> bool:
    """Whether a request to ``path`` is answered in Anthropic's shapes."""
    return path == ANTHROPIC_ROUTES or path.startswith(ANTHROPIC_ROUTES + "/")


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

    def anthropic_status(self) -> int:
        return OVERLOADED if self.status == 503 else self.status

    def anthropic_body(self) -> dict[str, Any]:
        status = self.anthropic_status()
        kind = _ANTHROPIC_TYPES.get(status)
        if kind is None:
            kind = "api_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def status_for(self, path: str) -> int:
        """The status of this error's answer to a request to ``path``."""
        return self.anthropic_status() if speaks_anthropic(path) else self.status

    def body_for(self, path: str) -> dict[str, Any]:
        """This error's body in the shape of the API ``path`` belongs to."""
        return self.anthropic_body() if speaks_anthropic(path) else self.body()

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
