"""Encoding and validating decoding of control commands and their replies."""

from __future__ import annotations

from typing import Any, Final

from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.fields import FieldReader
from mlx_redis_protocol.identifiers import (
    CACHE_NAME_RULE,
    ID_RULE,
    is_valid_cache_name,
    is_valid_id,
)
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.messages import ControlCommand, ControlReply, ErrorInfo
from mlx_redis_protocol.wire import pack, unpack

MAX_KIND_LEN: Final = 64
MAX_REPLY_TO_LEN: Final = 512
MAX_CODE_LEN: Final = 64
# Commands that need an argument, and which one.
KIND_ARGUMENT: Final = {
    "abort": "request_id",
    "cache_save": "name",
    "cache_load": "name",
}


def encode_command(command: ControlCommand) -> bytes:
    fields: dict[str, Any] = {"kind": command.kind, "id": command.id, "reply_to": command.reply_to}
    if command.request_id is not None:
        fields["request_id"] = command.request_id
    if command.name is not None:
        fields["name"] = command.name
    if command.model is not None:
        fields["model"] = command.model
    return pack(fields, "command")


def decode_command(data: object, limits: Limits = DEFAULT_LIMITS) -> ControlCommand:
    """A validated command. Raises only ProtocolError.

    A ``kind`` this reader doesn't know still decodes, so a worker can answer it with an
    `unknown_command` error instead of leaving the sender to time out.
    """
    reader = FieldReader(unpack(data, limits, "command"), "command", limits)
    kind = reader.required_string("kind", non_empty=True, max_len=MAX_KIND_LEN)
    command_id = _identifier(reader, "id", required=True)
    reply_to = reader.required_string("reply_to", non_empty=True, max_len=MAX_REPLY_TO_LEN)
    request_id = _identifier(reader, "request_id", required=kind == "abort")
    name = reader.string("name", required=KIND_ARGUMENT.get(kind) == "name")
    if name is not None and not is_valid_cache_name(name):
        raise reader.error("invalid_field", "name", f"must be {CACHE_NAME_RULE}")
    return ControlCommand(
        kind=kind,
        id=command_id or "",
        reply_to=reply_to,
        request_id=request_id,
        name=name,
        model=_identifier(reader, "model", required=False),
    )


def encode_reply(reply: ControlReply) -> bytes:
    fields: dict[str, Any] = {"id": reply.id, "ok": reply.ok, "worker_id": reply.worker_id}
    if reply.result is not None:
        fields["result"] = dict(reply.result)
    if reply.error is not None:
        fields["error"] = {"code": reply.error.code, "message": reply.error.message}
    return pack(fields, "reply")


def decode_reply(data: object, limits: Limits = DEFAULT_LIMITS) -> ControlReply:
    """A validated reply: ``ok`` with an optional ``result`` map, or not ok with an error."""
    reader = FieldReader(unpack(data, limits, "reply"), "reply", limits)
    # "" answers a refused command whose own id was unusable (the reply list says which).
    reply_id = reader.string("id", required=True) or ""
    if reply_id and not is_valid_id(reply_id):
        raise reader.error("invalid_field", "id", f"must be {ID_RULE} or empty")
    ok = reader.boolean("ok", required=True)
    worker_id = _identifier(reader, "worker_id", required=True) or ""
    result = reader.json_map("result")
    error = _error_info(reader)
    if ok and error is not None:
        raise ProtocolError("conflicting_fields", "reply is ok but carries an error")
    if not ok and error is None:
        raise reader.error("missing_field", "error", "is required when ok is false")
    return ControlReply(id=reply_id, ok=bool(ok), worker_id=worker_id, result=result, error=error)


def _identifier(reader: FieldReader, name: str, *, required: bool) -> str | None:
    value = reader.string(name, required=required)
    if value is not None and not is_valid_id(value):
        raise reader.error("invalid_field", name, f"must be {ID_RULE}")
    return value


def _error_info(reader: FieldReader) -> ErrorInfo | None:
    fields = reader.mapping("error")
    if fields is None:
        return None
    error = FieldReader(fields, "reply.error", reader.limits)
    return ErrorInfo(
        code=error.required_string("code", non_empty=True, max_len=MAX_CODE_LEN),
        message=error.required_string("message", max_len=reader.limits.max_str_len),
    )
