"""msgpack in and out of the protocol: bounded unpacking and the version envelope."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import msgpack  # type: ignore[import-untyped]  # ships no type hints

from mlx_redis_protocol.constants import PROTOCOL_VERSION
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.limits import Limits


def pack(fields: Mapping[str, Any], what: str) -> bytes:
    """A message map with the protocol version added.

    Encoders only see typed messages, but free-form parts (metadata, results) come from
    callers; a value msgpack can't encode is reported like any other invalid field.
    """
    try:
        packed: bytes = msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError("invalid_field", f"{what} can't be encoded: {exc}") from None
    return packed


def unpack(data: object, limits: Limits, what: str) -> dict[str, Any]:
    """Decode one message map, enforcing the size limits, and check its version.

    Raises only ProtocolError, whatever ``data`` is.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError("malformed", f"{what} must be bytes, got {type(data).__name__}")
    # Checked before unpacking: msgpack must never see (and allocate for) an oversized input.
    if len(data) > limits.max_message_bytes:
        raise ProtocolError(
            "too_large", f"{what} is {len(data)} bytes, limit {limits.max_message_bytes}"
        )
    try:
        value = _unpack(data, limits, "strict")
    except UnicodeDecodeError:
        # Not a msgpack fault: the sender's string is not UTF-8. Say which field, so the
        # sender can find it (a tenant name made of raw bytes, say).
        raise ProtocolError("invalid_field", _not_utf8(data, limits, what)) from None
    except ValueError as exc:
        # msgpack reports its own limits as ValueError("... exceeds max_str_len(...)"); an
        # extension type is refused through max_ext_len=0 but is malformed, not too long.
        detail = str(exc)
        if "exceeds max_" in detail and "max_ext_len" not in detail:
            raise ProtocolError("limit_exceeded", f"{what}: {exc}") from None
        raise ProtocolError(
            "malformed", f"{what} is not valid msgpack: {detail or type(exc).__name__}"
        ) from None
    except Exception as exc:
        # msgpack raises a zoo of types for hostile input (StackError, FormatError,
        # UnicodeDecodeError, TypeError for unhashable keys, ...): all mean "not a message".
        raise ProtocolError(
            "malformed", f"{what} is not valid msgpack: {type(exc).__name__}"
        ) from None
    if not isinstance(value, dict):
        raise ProtocolError("malformed", f"{what} must be a msgpack map")
    _check_version(value, what)
    return value


def _unpack(data: bytes | bytearray | memoryview, limits: Limits, unicode_errors: str) -> Any:
    return msgpack.unpackb(
        data,
        raw=False,
        unicode_errors=unicode_errors,
        strict_map_key=True,
        use_list=True,
        max_str_len=limits.max_str_len,
        max_bin_len=limits.max_bin_len,
        max_array_len=max(limits.max_array_len, limits.max_prompt_tokens),
        max_map_len=limits.max_map_len,
        # The protocol uses no extension types; refusing them keeps decoded values plain.
        max_ext_len=0,
        ext_hook=_refuse_extension,
    )


def _not_utf8(data: bytes | bytearray | memoryview, limits: Limits, what: str) -> str:
    """The message for a map with a string that is not UTF-8, naming its top-level field:
    decoded again with the bad bytes kept as surrogates, the field that holds one."""
    try:
        value = _unpack(data, limits, "surrogateescape")
    except Exception:  # any other fault: the general message will do
        value = None
    if isinstance(value, dict):
        for key, item in value.items():
            if _has_surrogates(key):
                return f"{what} has a field name that is not valid UTF-8"
            if _has_surrogates(item):
                return f"{what}: `{key}` is not valid UTF-8"
    return f"{what} has a string that is not valid UTF-8"


def _has_surrogates(value: Any) -> bool:
    if isinstance(value, str):
        return any("\udc80" <= char <= "\udcff" for char in value)
    if isinstance(value, list):
        return any(_has_surrogates(item) for item in value)
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    return False


def _refuse_extension(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not used by the protocol")


def _check_version(message: dict[str, Any], what: str) -> None:
    version = message.get("v")
    if version is None:  # nil counts as absent, for `v` as for every field
        raise ProtocolError("missing_field", f"{what} has no protocol version `v`")
    # Anything but the integer itself (a string "1", 1.0, true) is a version this reader does
    # not speak: the spec names one code for every other value.
    if isinstance(version, bool) or not isinstance(version, int) or version != PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported_version",
            f"{what} has protocol version {version!r}, this reader speaks {PROTOCOL_VERSION}",
        )


def top_level_strings(data: object, names: Collection[str]) -> dict[str, str]:
    """The str values of the given top-level keys of a msgpack map, read from a message that
    may be invalid in every other way: a wrong or missing version, other bad fields, extension
    types, non-str keys, over-limit values or size, trailing bytes. Used only to say *who*
    a rejected message came from (its request id, a command's reply list), so the sender hears
    why instead of waiting. Later pairs win, as in a decoded map; missing or non-str values are
    left out. Never raises.

    Values are skipped, not built, so this allocates nothing for what it does not return."""
    if not isinstance(data, bytes | bytearray | memoryview):
        return {}
    wanted = {name.encode(): name for name in names}
    found: dict[str, str] = {}
    # raw: keys and values stay bytes, so a bad UTF-8 string elsewhere cannot stop the walk.
    unpacker = msgpack.Unpacker(raw=True, max_buffer_size=max(len(data), 1), strict_map_key=False)
    view = bytes(data)
    try:
        unpacker.feed(view)
        pairs = unpacker.read_map_header()
        for _ in range(pairs):
            key_is_str = _str_at(view, unpacker.tell())
            key = unpacker.unpack()
            name = wanted.get(key) if key_is_str and isinstance(key, bytes) else None
            if name is None:
                unpacker.skip()
                continue
            value_is_str = _str_at(view, unpacker.tell())
            value = unpacker.unpack()
            if value_is_str and isinstance(value, bytes):
                with contextlib.suppress(UnicodeDecodeError):
                    found[name] = value.decode()
                    continue
            found.pop(name, None)  # a later non-str value replaces an earlier str one
    except Exception:  # truncated or hostile input: what was read so far is all there is
        pass
    return found


def _str_at(data: bytes, offset: int) -> bool:
    """Whether the msgpack value at ``offset`` is a str (raw unpacking returns str and bin
    alike as bytes; the protocol's strings are never bin)."""
    if offset >= len(data):
        return False
    head = data[offset]
    return 0xA0 <= head <= 0xBF or head in (0xD9, 0xDA, 0xDB)
