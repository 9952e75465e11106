"""Whatever the bytes, a decoder returns a typed message or raises ProtocolError, nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.messages import ControlCommand, ControlReply, EventBase, Job
from tests.protocol.messages_samples import DECODERS, KINDS

Decoder = Callable[..., Any]
TYPED = (Job, EventBase, ControlCommand, ControlReply)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALID_MESSAGES = [encode(sample) for _name, samples, encode, _ in KINDS for sample in samples]

# Any value msgpack can carry, including the nasty ones: NaN, infinities, huge integers,
# bytes where text is expected, and containers nested a few levels.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


def decode_safely(decode: Decoder, data: bytes) -> None:
    """The property: a typed message or a ProtocolError with a known code."""
    try:
        result = decode(data)
    except ProtocolError as exc:
        assert exc.code
        return
    assert isinstance(result, TYPED)


@FUZZ
@given(data=st.binary(max_size=300))
@pytest.mark.parametrize("decode", DECODERS)
def test_arbitrary_bytes(decode: Decoder, data: bytes) -> None:
    decode_safely(decode, data)


@FUZZ
@given(message=st.sampled_from(VALID_MESSAGES), data=st.data())
@pytest.mark.parametrize("decode", DECODERS)
def test_mutated_bytes(decode: Decoder, message: bytes, data: st.DataObject) -> None:
    mutated = bytearray(message)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(mutated)))
        action = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if action == "flip" and position < len(mutated):
            mutated[position] ^= data.draw(st.integers(1, 255))
        elif action == "insert":
            mutated[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del mutated[position : position + data.draw(st.integers(1, 8))]
        else:
            del mutated[position:]
    decode_safely(decode, bytes(mutated))


@FUZZ
@given(message=st.sampled_from(VALID_MESSAGES), data=st.data())
@pytest.mark.parametrize("decode", DECODERS)
def test_fields_replaced_with_wrong_values(
    decode: Decoder, message: bytes, data: st.DataObject
) -> None:
    fields = msgpack.unpackb(message)
    names = [*sorted(fields), "v", "seq", "max_tokens", "metadata", "usage", "result"]
    for _ in range(data.draw(st.integers(1, 3))):
        fields[data.draw(st.sampled_from(names))] = data.draw(msgpack_values)
    decode_safely(decode, msgpack.packb(fields))


@FUZZ
@given(value=msgpack_values)
@pytest.mark.parametrize("decode", DECODERS)
def test_arbitrary_msgpack_values(decode: Decoder, value: Any) -> None:
    decode_safely(decode, msgpack.packb(value))


def nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # fixarray of one element, `depth` times, then nil


def map_claiming(count: int) -> bytes:
    return b"\xdf" + count.to_bytes(4, "big")  # map32 header, no entries


HOSTILE = [
    pytest.param(nested_arrays(100_000), id="deep nesting"),
    pytest.param(msgpack.packb({"v": 1, "metadata": {"a": [[[[[[[[[[1]]]]]]]]]]}}), id="deep meta"),
    pytest.param(map_claiming(2**32 - 1), id="map header claiming 4G entries"),
    pytest.param(b"\xdd\xff\xff\xff\xff", id="array header claiming 4G items"),
    pytest.param(b"\xdb\xff\xff\xff\xff", id="str header claiming 4 GiB"),
    pytest.param(b"\xc6\xff\xff\xff\xff", id="bin header claiming 4 GiB"),
    pytest.param(msgpack.packb({"v": 1, "prompt": "x" * 600_000}), id="huge string"),
    pytest.param(msgpack.packb({"v": 1, "prompt_token_ids": [1] * 40_000}), id="huge list"),
    pytest.param(b"\x00" * 2_000_000, id="over max_message_bytes"),
    pytest.param(msgpack.packb({"v": 2, "request_id": "r"}), id="unknown version"),
    pytest.param(msgpack.packb({"v": 1, "max_tokens": float("nan")}), id="nan"),
    pytest.param(msgpack.packb({"v": 1, "prompt": "x", "max_tokens": -(2**63)}), id="neg"),
    pytest.param(msgpack.packb({"v": 1, "prompt": "x", "max_tokens": 2**64 - 1}), id="enormous"),
    pytest.param(msgpack.packb({1: 2}), id="integer key"),
    pytest.param(b"\x81\x91\x01\x01", id="unhashable key"),
    pytest.param(b"\xa3\xff\xfe\xfd", id="invalid utf-8"),
]


@pytest.mark.parametrize("data", HOSTILE)
@pytest.mark.parametrize("decode", DECODERS)
def test_hostile_inputs_are_protocol_errors(decode: Decoder, data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


@pytest.mark.parametrize("value", [None, "text", 5, [b"x"], memoryview(b"\x80")])
@pytest.mark.parametrize("decode", DECODERS)
def test_non_bytes_input(decode: Decoder, value: Any) -> None:
    decode_safely(decode, value)
