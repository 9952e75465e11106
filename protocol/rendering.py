"""Events and replies as JSON-ready dicts and as text for people, plus exit codes.

JSON output is strict (no NaN or Infinity tokens): non-finite floats, which only a
log-probability of -inf can produce, become null.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from typing import Any

from protocol.messages import ControlReply, DoneEvent, ErrorEvent, Event, UnknownEvent


class ExitCode(enum.IntEnum):
    """The command line's exit statuses (documented in protocol/README.md)."""

    OK = 0  # done with finish_reason stop or length; a control command answered ok
    ERROR = 1  # an `error` event; a control reply that is not ok
    USAGE = 2  # bad arguments, Redis unreachable or refusing, a protocol violation
    ABORTED = 3  # done with finish_reason abort or expired
    NOT_FOUND = 4  # no such request, or its log expired
    TIMEOUT = 5  # no event / no control reply within --timeout


EXIT_CODES_HELP = """exit status:
  0  done (finish_reason stop or length); control command answered ok
  1  the request ended with an error event; a control reply was not ok
  2  usage error, Redis unreachable or refusing, protocol violation
  3  the request was aborted or expired (finish_reason abort / expired)
  4  unknown request, or its replay log expired
  5  timed out waiting for an event or a control reply"""


def exit_code_for(event: DoneEvent | ErrorEvent) -> ExitCode:
    if isinstance(event, ErrorEvent):
        return ExitCode.ERROR
    return ExitCode.OK if event.finish_reason in ("stop", "length") else ExitCode.ABORTED


def event_as_dict(event: Event) -> dict[str, Any]:
    """The event's fields with its ``type`` first, JSON-ready."""
    fields = dataclasses.asdict(event)
    if isinstance(event, UnknownEvent):
        event_type = fields.pop("event_type")
        extra = fields.pop("fields")
        fields = {**extra, **fields}
    else:
        event_type = event.type
    return {"type": event_type, **_json_ready(fields)}


def reply_as_dict(reply: ControlReply) -> dict[str, Any]:
    fields: dict[str, Any] = _json_ready(dataclasses.asdict(reply))
    return fields


def json_line(fields: Mapping[str, Any]) -> str:
    return json.dumps(fields, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def describe_reply(reply: ControlReply) -> str:
    """One line per reply: the worker, then its result or its error."""
    if reply.ok:
        result = json_line(_json_ready(dict(reply.result))) if reply.result is not None else ""
        return f"{reply.worker_id}: ok {result}".rstrip()
    assert reply.error is not None  # the decoder guarantees an error when not ok
    return f"{reply.worker_id}: error {reply.error.code}: {reply.error.message}"


def _json_ready(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(item) for item in value]
    return value
