"""A job's ``response_format`` and a done event's ``output_valid`` on the wire: round trips,
and the decoder's refusals, each with its code and the field it names."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from mlx_redis_protocol.client import build_job
from mlx_redis_protocol.codec_events import decode_event, encode_event
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.messages import DoneEvent, Job, Usage

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"enum": ["a", "b", None, 1.5, True]}},
    },
    "required": ["name"],
    "additionalProperties": False,
}

FORMATS: list[dict[str, Any]] = [
    {"type": "json_object"},
    {"type": "json_schema", "schema": SCHEMA},
    {"type": "json_schema", "schema": {}},
    {"type": "regex", "pattern": r"[a-c]{2,4}-[0-9]+"},
    {"type": "grammar", "lark": 'start: "(" item ("," item)* ")"\nitem: "x" | "y"'},
]


@pytest.mark.parametrize("response_format", FORMATS, ids=lambda f: f["type"])
def test_each_response_format_type_round_trips(response_format: dict[str, Any]) -> None:
    job = Job(request_id="r1", prompt="hi", response_format=response_format)
    decoded = decode_job(encode_job(job))
    assert decoded == job
    assert decoded.response_format is not None
    assert dict(decoded.response_format) == response_format


def test_a_schemas_key_order_survives_the_wire() -> None:
    """The order of a schema's properties is the order of the output's keys."""
    schema = {"type": "object", "properties": {"b": {}, "a": {}, "c": {}}}
    job = Job(
        request_id="r1", prompt="hi", response_format={"type": "json_schema", "schema": schema}
    )
    decoded = decode_job(encode_job(job))
    assert decoded.response_format is not None
    assert list(decoded.response_format["schema"]["properties"]) == ["b", "a", "c"]


def test_a_job_without_response_format_has_none() -> None:
    decoded = decode_job(encode_job(Job(request_id="r1", prompt="hi")))
    assert decoded.response_format is None
    assert "response_format" not in msgpack.unpackb(encode_job(Job(request_id="r1", prompt="x")))


def nested(depth: int) -> dict[str, Any]:
    """A schema whose maps nest ``depth`` deep (the schema itself is level 1)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def job_with(response_format: Any) -> bytes:
    data: bytes = msgpack.packb(
        {"v": 1, "request_id": "r1", "prompt": "hi", "response_format": response_format}
    )
    return data


# (name, response_format, code, the field the message names)
REFUSALS: list[tuple[str, Any, str, str]] = [
    ("not a map", "json", "invalid_field", "job.response_format "),
    ("no type", {"schema": {}}, "missing_field", "job.response_format.type "),
    ("type not a string", {"type": 1}, "invalid_field", "job.response_format.type "),
    ("unknown type", {"type": "xml"}, "invalid_field", "job.response_format.type "),
    ("text is not a type", {"type": "text"}, "invalid_field", "job.response_format.type "),
    ("schema missing", {"type": "json_schema"}, "missing_field", "job.response_format.schema "),
    ("pattern missing", {"type": "regex"}, "missing_field", "job.response_format.pattern "),
    ("lark missing", {"type": "grammar"}, "missing_field", "job.response_format.lark "),
    (
        "json_object with a schema",
        {"type": "json_object", "schema": {}},
        "invalid_field",
        "job.response_format.schema ",
    ),
    (
        "regex with a lark",
        {"type": "regex", "pattern": "a", "lark": "b"},
        "invalid_field",
        "job.response_format.lark ",
    ),
    (
        "schema with a pattern",
        {"type": "json_schema", "schema": {}, "pattern": "a"},
        "invalid_field",
        "job.response_format.pattern ",
    ),
    (
        "unknown field",
        {"type": "grammar", "lark": "start: 'a'", "strict": True},
        "invalid_field",
        "job.response_format.strict ",
    ),
    (
        "str and bytes extra keys",
        {"type": "regex", "pattern": "a", b"raw": 1, "other": 2},
        "invalid_field",
        "job.response_format.",
    ),
    (
        "schema not a map",
        {"type": "json_schema", "schema": ["type", "object"]},
        "invalid_field",
        "job.response_format.schema ",
    ),
    (
        "schema a string",
        {"type": "json_schema", "schema": '{"type": "object"}'},
        "invalid_field",
        "job.response_format.schema ",
    ),
    (
        "schema with bytes",
        {"type": "json_schema", "schema": {"const": b"raw"}},
        "invalid_field",
        "job.response_format.schema ",
    ),
    (
        "schema with NaN",
        {"type": "json_schema", "schema": {"maximum": float("nan")}},
        "invalid_field",
        "job.response_format.schema ",
    ),
    (
        "schema too deep",
        {"type": "json_schema", "schema": nested(DEFAULT_LIMITS.max_schema_depth + 1)},
        "limit_exceeded",
        "job.response_format.schema ",
    ),
    (
        "empty pattern",
        {"type": "regex", "pattern": ""},
        "invalid_field",
        "job.response_format.pattern ",
    ),
    (
        "pattern not a string",
        {"type": "regex", "pattern": 5},
        "invalid_field",
        "job.response_format.pattern ",
    ),
    ("empty lark", {"type": "grammar", "lark": ""}, "invalid_field", "job.response_format.lark "),
]


@pytest.mark.parametrize(
    ("response_format", "code", "field"),
    [pytest.param(f, c, n, id=name) for name, f, c, n in REFUSALS],
)
def test_refusals_have_their_code_and_name_the_field(
    response_format: Any, code: str, field: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_job(job_with(response_format))
    assert caught.value.code == code
    assert caught.value.message.startswith(field), caught.value.message
    assert caught.value.request_id == "r1"  # answerable: the worker sends it an error event


def test_a_schema_at_the_depth_limit_is_accepted_and_the_limit_is_configurable() -> None:
    depth = DEFAULT_LIMITS.max_schema_depth
    fmt = {"type": "json_schema", "schema": nested(depth)}
    decoded = decode_job(job_with(fmt))
    assert decoded.response_format == fmt
    with pytest.raises(ProtocolError) as caught:
        decode_job(job_with(fmt), Limits(max_schema_depth=depth - 1))
    assert caught.value.code == "limit_exceeded"
    deeper = {"type": "json_schema", "schema": nested(depth + 1)}
    assert decode_job(job_with(deeper), Limits(max_schema_depth=depth + 1)).response_format


def test_a_pattern_over_the_string_limit_is_refused() -> None:
    fmt = {"type": "regex", "pattern": "a" * 65}
    with pytest.raises(ProtocolError) as caught:
        decode_job(job_with(fmt), Limits(max_str_len=64))
    assert caught.value.code == "limit_exceeded"  # msgpack's reader stops it, as any string


def done(output_valid: bool | None) -> DoneEvent:
    return DoneEvent(
        request_id="r1",
        seq=3,
        attempt=1,
        finish_reason="stop",
        output_text='{"ok": true}',
        usage=Usage(5, 4),
        output_valid=output_valid,
    )


@pytest.mark.parametrize("output_valid", [True, False, None])
def test_done_output_valid_round_trips(output_valid: bool | None) -> None:
    event = done(output_valid)
    data = encode_event(event)
    assert decode_event(data) == event
    fields = msgpack.unpackb(data)
    if output_valid is None:
        assert "output_valid" not in fields  # absent for an unconstrained job
    else:
        assert fields["output_valid"] is output_valid


def test_done_output_valid_must_be_a_boolean() -> None:
    fields = msgpack.unpackb(encode_event(done(True)))
    fields["output_valid"] = 1
    with pytest.raises(ProtocolError) as caught:
        decode_event(msgpack.packb(fields))
    assert caught.value.code == "invalid_field"
    assert "output_valid" in caught.value.message


@pytest.mark.parametrize("response_format", ["json_object", ["type", "json_object"], 3])
def test_a_client_given_a_response_format_that_is_no_map_raises_protocol_error(
    response_format: Any,
) -> None:
    """Not a TypeError or ValueError from inside the encoder: the caller's typed error."""
    with pytest.raises(ProtocolError, match=r"job\.response_format must be a map"):
        build_job(
            prompt="hi",
            prompt_token_ids=None,
            messages=None,
            request_id="r1",
            options={"response_format": response_format},
        )


def test_nil_fields_of_a_response_format_count_as_absent() -> None:
    """As everywhere in a job: a producer that sends every field it knows, nil where unused."""
    unused = {"type": "json_object", "schema": None, "pattern": None}
    assert decode_job(job_with(unused)).response_format == {"type": "json_object"}
    with pytest.raises(ProtocolError) as caught:
        decode_job(job_with({"type": "regex", "pattern": None}))
    assert caught.value.message.startswith("job.response_format.pattern"), caught.value.message
