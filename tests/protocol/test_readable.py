"""Who a rejected message came from: a job's request id, read from whatever else is wrong."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_redis_protocol.codec_job import decode_job, readable_request_id
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.wire import top_level_strings

junk_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.integers(-1000, 1000) | st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
junk_keys = st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.text(max_size=12).filter(
    lambda k: k != "request_id"
)


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.tuples(junk_keys, junk_values), max_size=5),
    after=st.lists(st.tuples(junk_keys, junk_values), max_size=5),
    trailing=st.binary(max_size=16),
)
def test_the_request_id_is_read_whatever_surrounds_it(
    before: list[tuple[Any, Any]], after: list[tuple[Any, Any]], trailing: bytes
) -> None:
    pairs = [*before, ("request_id", "job-7"), *after]
    data = _map(pairs) + trailing
    assert readable_request_id(data) == "job-7"


@pytest.mark.parametrize(
    ("name", "fields", "code"),
    [
        ("no version", {"prompt": "hi"}, "missing_field"),
        ("version 2", {"v": 2, "prompt": "hi"}, "unsupported_version"),
        ("version as text", {"v": "1", "prompt": "hi"}, "unsupported_version"),
        ("version as float", {"v": 1.0, "prompt": "hi"}, "unsupported_version"),
        ("version as bool", {"v": True, "prompt": "hi"}, "unsupported_version"),
        ("oversized prompt", {"v": 1, "prompt": "x" * (DEFAULT_LIMITS.max_str_len + 1)}, None),
        ("extension type", {"v": 1, "prompt": msgpack.ExtType(3, b"x")}, "malformed"),
    ],
)
def test_a_rejected_job_names_its_request(
    name: str, fields: dict[str, Any], code: str | None
) -> None:
    data = msgpack.packb({**fields, "request_id": "r-" + name.replace(" ", "-")})
    with pytest.raises(ProtocolError) as raised:
        decode_job(data)
    assert raised.value.request_id == "r-" + name.replace(" ", "-")
    if code is not None:
        assert raised.value.code == code


def test_non_string_keys_trailing_bytes_and_size_do_not_hide_the_request_id() -> None:
    cases = {
        "int key": _map([(1, 2), ("v", 1), ("request_id", "a"), ("prompt", "p")]),
        "trailing": msgpack.packb({"v": 1, "request_id": "b", "prompt": "p"}) + b"\x00",
        "too large": msgpack.packb(
            {"v": 1, "request_id": "c", "prompt": "x" * (DEFAULT_LIMITS.max_message_bytes + 1)}
        ),
    }
    for name, data in cases.items():
        with pytest.raises(ProtocolError) as raised:
            decode_job(data)
        assert raised.value.request_id is not None, name


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not msgpack",
        msgpack.packb(["request_id", "x"]),
        msgpack.packb({"request_id": 7}),
        msgpack.packb({"request_id": "has space"}),
        msgpack.packb({"request_id": b"bytes-not-str"}),
        msgpack.packb({"nested": {"request_id": "inner"}}),
        b"\xdf\xff\xff\xff\xff",  # a map header promising 4 billion pairs, then nothing
        msgpack.packb({"request_id": "early"})[:-3],  # truncated
    ],
)
def test_no_readable_request_id(data: bytes) -> None:
    assert readable_request_id(data) is None


def test_the_last_of_two_request_ids_counts_as_in_a_decoded_map() -> None:
    data = _map([("request_id", "first"), ("request_id", "second")])
    assert top_level_strings(data, ("request_id",)) == {"request_id": "second"}
    assert top_level_strings(_map([("request_id", "a"), ("request_id", 5)]), ("request_id",)) == {}


def _map(pairs: list[tuple[Any, Any]]) -> bytes:
    """A msgpack map with the pairs in order, duplicates and non-str keys kept."""
    packer = msgpack.Packer(use_bin_type=True)
    body = b"".join(packer.pack(key) + packer.pack(value) for key, value in pairs)
    return bytes(packer.pack_map_header(len(pairs))) + body
