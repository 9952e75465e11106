"""Encoding and validating decoding of the events on a request's channel and log."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final, TypedDict

from mlx_redis_protocol.codec_tools import (
    encode_tool_call,
    encode_tool_call_delta,
    read_tool_call_deltas,
    read_tool_calls,
)
from mlx_redis_protocol.fields import FieldReader, is_integer, json_like_problem
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.messages import (
    FINISH_REASONS,
    DeltaEvent,
    DoneEvent,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    QueuedEvent,
    ResetEvent,
    TokenLogprob,
    UnknownEvent,
    Usage,
)
from mlx_redis_protocol.wire import pack, unpack

COMMON_FIELDS: Final = ("v", "type", "request_id", "seq", "attempt")
MAX_CODE_LEN: Final = 64


def encode_event(event: Event) -> bytes:
    """The msgpack map published on the channel and stored in the log."""
    fields: dict[str, Any] = {
        "type": event.event_type if isinstance(event, UnknownEvent) else event.type,
        "request_id": event.request_id,
        "seq": event.seq,
        "attempt": event.attempt,
    }
    if isinstance(event, DeltaEvent):
        fields["new_text"] = event.new_text
        fields["new_token_ids"] = list(event.new_token_ids)
        if event.logprobs is not None:
            fields["logprobs"] = [_logprob_fields(item) for item in event.logprobs]
        if event.reasoning:
            fields["reasoning"] = event.reasoning
        if event.tool_calls:
            fields["tool_calls"] = [encode_tool_call_delta(d) for d in event.tool_calls]
    elif isinstance(event, EmbeddingEvent):
        fields["index"] = event.index
        fields["data"] = list(event.vectors)
    elif isinstance(event, DoneEvent):
        fields["finish_reason"] = event.finish_reason
        fields["output_text"] = event.output_text
        fields["usage"] = _usage_fields(event.usage)
        if event.output_valid is not None:
            fields["output_valid"] = event.output_valid
        if event.reasoning_text:
            fields["reasoning_text"] = event.reasoning_text
        if event.tool_calls:
            fields["tool_calls"] = [encode_tool_call(call) for call in event.tool_calls]
        if event.stop_sequence is not None:
            fields["stop_sequence"] = event.stop_sequence
    elif isinstance(event, ErrorEvent):
        fields["code"] = event.code
        fields["message"] = event.message
    elif isinstance(event, UnknownEvent):
        fields = {**event.fields, **fields}
    if isinstance(event, DoneEvent | ErrorEvent) and event.metadata is not None:
        fields["metadata"] = dict(event.metadata)
    return pack(fields, "event")


def decode_event(data: object, limits: Limits = DEFAULT_LIMITS) -> Event:
    """A validated event. Raises only ProtocolError.

    An unknown ``type`` (from a newer writer) decodes to UnknownEvent so readers keep counting
    ``seq`` and can skip it.
    """
    reader = FieldReader(unpack(data, limits, "event"), "event", limits)
    request_id = reader.required_string("request_id")
    if not is_valid_id(request_id):
        raise reader.error("invalid_field", "request_id", f"must be {ID_RULE}")
    reader.request_id = request_id
    event_type = reader.required_string("type", non_empty=True, max_len=MAX_CODE_LEN)
    seq = reader.required_integer("seq", minimum=0)
    attempt = reader.required_integer("attempt", minimum=0)
    if event_type == "queued" and seq != 0:
        raise reader.error("invalid_field", "seq", "of a queued event must be 0")
    if event_type != "queued" and seq < 1:
        raise reader.error("invalid_field", "seq", f"of a {event_type} event must be >= 1")
    common = _Common(request_id=request_id, seq=seq, attempt=attempt)
    decode = _DECODERS.get(event_type)
    if decode is None:
        return _unknown_event(reader, common, event_type)
    return decode(reader, common)


class _Common(TypedDict):
    """The fields every event has, already checked; passed on as keywords (``**common``).
    A dict, not a NamedTuple: its ``_asdict`` cost a subscriber about 1 µs on every event."""

    request_id: str
    seq: int
    attempt: int


def _queued_event(reader: FieldReader, common: _Common) -> Event:
    return QueuedEvent(**common)


def _delta_event(reader: FieldReader, common: _Common) -> Event:
    return DeltaEvent(
        **common,
        new_text=reader.required_string("new_text", max_len=reader.limits.max_str_len),
        new_token_ids=_new_token_ids(reader),
        logprobs=_logprobs(reader),
        reasoning=reader.string("reasoning", max_len=reader.limits.max_str_len) or "",
        tool_calls=read_tool_call_deltas(reader),
    )


def _embedding_event(reader: FieldReader, common: _Common) -> Event:
    index = reader.required_integer("index", minimum=0)
    items = reader.array("data", required=True, max_items=reader.limits.max_embedding_inputs)
    assert items is not None  # required=True raised already
    if not items or not all(
        isinstance(item, bytes) and item and len(item) % 4 == 0 and len(item) == len(items[0])
        for item in items
    ):
        raise reader.error(
            "invalid_field", "data", "must hold vectors of one length: float32 bytes each"
        )
    return EmbeddingEvent(**common, index=index, vectors=tuple(items))


def _done_event(reader: FieldReader, common: _Common) -> Event:
    finish_reason = reader.required_string("finish_reason")
    if finish_reason not in FINISH_REASONS:
        raise reader.error("invalid_field", "finish_reason", f"must be one of {FINISH_REASONS}")
    return DoneEvent(
        **common,
        finish_reason=FINISH_REASONS[FINISH_REASONS.index(finish_reason)],
        output_text=reader.required_string("output_text", max_len=reader.limits.max_str_len),
        usage=_usage(reader),
        metadata=reader.metadata("metadata"),
        output_valid=reader.boolean("output_valid"),
        reasoning_text=reader.string("reasoning_text", max_len=reader.limits.max_str_len) or "",
        tool_calls=read_tool_calls(reader),
        stop_sequence=reader.string("stop_sequence", max_len=reader.limits.max_stop_len),
    )


def _error_event(reader: FieldReader, common: _Common) -> Event:
    return ErrorEvent(
        **common,
        code=reader.required_string("code", non_empty=True, max_len=MAX_CODE_LEN),
        message=reader.required_string("message", max_len=reader.limits.max_str_len),
        metadata=reader.metadata("metadata"),
    )


def _reset_event(reader: FieldReader, common: _Common) -> Event:
    if common["attempt"] < 1:
        raise reader.error("invalid_field", "attempt", "of a reset event must be >= 1")
    return ResetEvent(**common)


def _unknown_event(reader: FieldReader, common: _Common, event_type: str) -> Event:
    # Kept for display only, so only what any consumer can print (and recurse into) stays.
    depth = reader.limits.max_metadata_depth
    extra = {
        key: value
        for key, value in reader.message.items()
        if key not in COMMON_FIELDS and json_like_problem(value, depth) is None
    }
    return UnknownEvent(**common, event_type=event_type, fields=extra)


_DECODERS: Final[dict[str, Callable[[FieldReader, _Common], Event]]] = {
    "queued": _queued_event,
    "delta": _delta_event,
    "embedding": _embedding_event,
    "done": _done_event,
    "error": _error_event,
    "reset": _reset_event,
}


def _new_token_ids(reader: FieldReader) -> tuple[int, ...]:
    token_ids = reader.token_ids("new_token_ids", max_items=reader.limits.max_array_len)
    return token_ids if token_ids is not None else ()


def _logprobs(reader: FieldReader) -> tuple[TokenLogprob, ...] | None:
    items = reader.array("logprobs", max_items=reader.limits.max_array_len)
    if items is None:
        return None
    return tuple(_token_logprob(reader, index, item) for index, item in enumerate(items))


def _token_logprob(reader: FieldReader, index: int, item: object) -> TokenLogprob:
    name = f"logprobs[{index}]"
    if not isinstance(item, dict):
        raise reader.error("invalid_field", name, "must be a map")
    token_id: Any = item.get("token_id")
    logprob: Any = item.get("logprob")
    if not is_integer(token_id) or token_id < 0 or not _is_logprob(logprob):
        raise reader.error("invalid_field", name, "needs token_id >= 0 and a logprob <= 0")
    top = item.get("top_logprobs", [])
    most = reader.limits.max_logprobs
    if not isinstance(top, list) or len(top) > most:
        raise reader.error("invalid_field", name, f"top_logprobs must be at most {most} pairs")
    pairs = []
    for pair in top:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and is_integer(pair[0])
            and pair[0] >= 0
            and _is_logprob(pair[1])
        ):
            raise reader.error("invalid_field", name, "top_logprobs must be [token_id, logprob]")
        pairs.append((int(pair[0]), float(pair[1])))
    token_bytes = item.get("bytes")
    if token_bytes is not None and not _is_token_bytes(token_bytes, reader.limits):
        raise reader.error("invalid_field", name, _TOKEN_BYTES_RULE)
    top_bytes = item.get("top_bytes")
    if top_bytes is not None and not (
        isinstance(top_bytes, list)
        and len(top_bytes) == len(pairs)
        and all(_is_token_bytes(entry, reader.limits) for entry in top_bytes)
    ):
        raise reader.error(
            "invalid_field",
            name,
            f"top_bytes must hold one per top_logprobs pair; each {_TOKEN_BYTES_RULE}",
        )
    return TokenLogprob(
        token_id=int(token_id),
        logprob=float(logprob),
        top_logprobs=tuple(pairs),
        token_bytes=token_bytes,
        top_token_bytes=tuple(top_bytes) if top_bytes is not None else None,
    )


_TOKEN_BYTES_RULE = "bytes must be binary of at most max_token_bytes"


def _is_token_bytes(value: object, limits: Limits) -> bool:
    return isinstance(value, bytes) and len(value) <= limits.max_token_bytes


def _is_logprob(value: object) -> bool:
    """A log-probability: <= 0, possibly -inf (a token the filters ruled out), never NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not math.isnan(value) and value <= 0


def _logprob_fields(item: TokenLogprob) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "token_id": item.token_id,
        "logprob": item.logprob,
        "top_logprobs": [[token_id, logprob] for token_id, logprob in item.top_logprobs],
    }
    if item.token_bytes is not None:
        fields["bytes"] = item.token_bytes
    if item.top_token_bytes is not None:
        fields["top_bytes"] = list(item.top_token_bytes)
    return fields


def _usage(reader: FieldReader) -> Usage:
    fields = reader.mapping("usage", required=True)
    usage = FieldReader(fields or {}, "event.usage", reader.limits)
    usage.request_id = reader.request_id
    return Usage(
        prompt_tokens=usage.required_integer("prompt_tokens", minimum=0),
        completion_tokens=usage.required_integer("completion_tokens", minimum=0),
        cached_tokens=usage.integer("cached_tokens", minimum=0) or 0,
        ttft_ms=usage.number("ttft_ms", minimum=0.0),
        tokens_per_second=usage.number("tokens_per_second", minimum=0.0) or 0.0,
        duration_ms=usage.number("duration_ms", minimum=0.0) or 0.0,
    )


def _usage_fields(usage: Usage) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
        "tokens_per_second": usage.tokens_per_second,
        "duration_ms": usage.duration_ms,
    }
    if usage.ttft_ms is not None:
        fields["ttft_ms"] = usage.ttft_ms
    return fields
