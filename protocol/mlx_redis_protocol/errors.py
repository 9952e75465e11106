"""The protocol's error codes (one table) and the exceptions of the protocol and client."""

from __future__ import annotations

from typing import Final

# Every error code on the wire: in ProtocolError, in `error` events and in control replies.
ERROR_CODES: Final[dict[str, str]] = {
    # Raised by the decoders.
    "malformed": "not msgpack, trailing bytes, not a map, or an unsupported msgpack type",
    "too_large": "the message is longer than max_message_bytes",
    "unsupported_version": "the message's `v` is not a protocol version this reader speaks",
    "missing_field": "a required field is absent",
    "invalid_field": "a field has the wrong type or a value out of range",
    "limit_exceeded": "a string, list, prompt, max_tokens or metadata is over its limit",
    "conflicting_fields": "fields that exclude each other are both set (e.g. two prompt kinds)",
    # Sent by workers in `error` events.
    "invalid_job": "the job failed validation (the message says which field and why)",
    "dead_lettered": "the job failed too many deliveries and was moved to the dead stream",
    "engine_error": "the inference engine failed while running the request",
    "internal": "an unexpected worker failure",
    "unknown_model": "no live worker serves the model the job names",
    "already_finished": (
        "the request id finished earlier (within the idempotency window) and its log expired:"
        " the job queued again under it was not run"
    ),
    # Sent by workers in control replies.
    "unknown_command": "the worker does not implement this control command",
    "not_found": "the named thing (a saved cache, a request) does not exist",
    "incompatible_cache": (
        "a saved prefix cache was made by another model (the message names both fingerprints)"
        " or is unreadable"
    ),
}


class ProtocolError(Exception):
    """A message that does not follow the protocol.

    ``request_id`` is set when a job was readable enough to name its request, so the worker
    can answer that request with an `error` event instead of silently dropping it.
    """

    def __init__(self, code: str, message: str, *, request_id: str | None = None) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"unknown protocol error code {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class ClientError(Exception):
    """Base of the client library's own failures (not Redis connection errors)."""


class RedisUnavailable(ClientError, ConnectionError):
    """Redis could not be reached, or did not answer in time (a connection refused or lost, a
    reply past the socket timeout). A command that timed out may still have run."""


class RequestNotFound(ClientError):
    """The request has no replay log: it was never queued, its log expired, or Redis lost it.
    Where the client can tell which, it raises one of the two subclasses."""

    def __init__(
        self,
        request_id: str,
        detail: str = "no replay log: never queued, its log expired, or Redis lost it",
    ) -> None:
        super().__init__(f"request {request_id!r}: {detail}")
        self.request_id = request_id


class RequestExpired(RequestNotFound):
    """The request's log expired by its TTL (the log TTL after its last event, 600 s by
    default): its events are gone for good, as designed."""


class RequestLost(RequestNotFound):
    """The request's log vanished before its TTL could have run out: Redis lost the data
    (restarted empty, flushed, evicted the key, or failed over to a replica that lacked it),
    or someone deleted it. The job may be lost with it: queue it again."""


class StreamRewritten(ClientError):
    """The request's history changed under a subscriber: Redis lost events it had already
    delivered (a failover to a replica that had not received them), and the job ran again
    over the same seqs. Follow the request again from the start; the log is whole again."""

    def __init__(self, request_id: str, detail: str) -> None:
        super().__init__(f"request {request_id!r}: its events were rewritten ({detail})")
        self.request_id = request_id


class StreamTimeout(ClientError, TimeoutError):
    """No event arrived for a request within the stream's timeout (whatever the reason: a job
    still queued, a slow worker, or Redis unreachable for that long)."""


class ControlTimeout(ClientError, TimeoutError):
    """No worker replied to a control command within its timeout."""
