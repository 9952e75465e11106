"""Typed, bounded reads of fields out of a decoded message map.

Every failure is a ProtocolError naming the message and the field. Types are strict: a bool
is not an integer, an integer is a fine float, NaN and infinities are refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import msgpack  # type: ignore[import-untyped]  # ships no type hints

from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.limits import Limits

_ABSENT: Final = object()
_TOO_DEEP: Final = "is nested too deeply"


class FieldReader:
    """Reads the fields of one message; ``request_id`` is attached to every error it raises."""

    def __init__(self, message: Mapping[str, Any], what: str, limits: Limits) -> None:
        self.message = message
        self.what = what
        self.limits = limits
        self.request_id: str | None = None

    def error(self, code: str, name: str, rule: str) -> ProtocolError:
        return ProtocolError(code, f"{self.what}.{name} {rule}", request_id=self.request_id)

    def nested(self, name: str, value: object) -> FieldReader:
        """A reader of the map ``value`` found at ``name`` (its errors name ``what.name``
        and carry this reader's request id); ``invalid_field`` when it is no map."""
        if not isinstance(value, dict):
            raise self.error("invalid_field", name, "must be a map")
        reader = FieldReader(value, f"{self.what}.{name}", self.limits)
        reader.request_id = self.request_id
        return reader

    def has(self, name: str) -> bool:
        """True when the field is present and not nil (nil counts as absent)."""
        return self.message.get(name) is not None

    def _value(self, name: str, required: bool) -> Any:
        value = self.message.get(name)
        if value is None and required:
            raise self.error("missing_field", name, "is required")
        return _ABSENT if value is None else value

    def string(
        self, name: str, *, required: bool = False, non_empty: bool = False, max_len: int = 0
    ) -> str | None:
        value = self._value(name, required)
        if value is _ABSENT:
            return None
        if not isinstance(value, str):
            raise self.error("invalid_field", name, "must be a string")
        if non_empty and not value:
            raise self.error("invalid_field", name, "must not be empty")
        if max_len and len(value) > max_len:
            raise self.error("limit_exceeded", name, f"is longer than {max_len} characters")
        return value

    def required_string(self, name: str, *, non_empty: bool = False, max_len: int = 0) -> str:
        value = self.string(name, required=True, non_empty=non_empty, max_len=max_len)
        assert value is not None  # required=True raised already
        return value

    def required_integer(self, name: str, *, minimum: int | None = None) -> int:
        value = self.integer(name, required=True, minimum=minimum)
        assert value is not None  # required=True raised already
        return value

    def integer(
        self, name: str, *, required: bool = False, minimum: int | None = None
    ) -> int | None:
        value = self._value(name, required)
        if value is _ABSENT:
            return None
        if not is_integer(value):
            raise self.error("invalid_field", name, "must be an integer")
        if minimum is not None and value < minimum:
            raise self.error("invalid_field", name, f"must be >= {minimum}")
        return int(value)

    def number(
        self,
        name: str,
        *,
        required: bool = False,
        minimum: float | None = None,
        maximum: float | None = None,
        above: float | None = None,
    ) -> float | None:
        value = self._value(name, required)
        if value is _ABSENT:
            return None
        if not is_finite_number(value):
            raise self.error("invalid_field", name, "must be a finite number")
        number = float(value)
        if minimum is not None and number < minimum:
            raise self.error("invalid_field", name, f"must be >= {minimum}")
        if maximum is not None and number > maximum:
            raise self.error("invalid_field", name, f"must be <= {maximum}")
        if above is not None and number <= above:
            raise self.error("invalid_field", name, f"must be > {above}")
        return number

    def boolean(self, name: str, *, required: bool = False) -> bool | None:
        value = self._value(name, required)
        if value is _ABSENT:
            return None
        if not isinstance(value, bool):
            raise self.error("invalid_field", name, "must be a boolean")
        return value

    def array(
        self, name: str, *, required: bool = False, max_items: int, min_items: int = 0
    ) -> list[Any] | None:
        value = self._value(name, required)
        if value is _ABSENT:
            return None
        if not isinstance(value, list):
            raise self.error("invalid_field", name, "must be an array")
        if len(value) > max_items:
            raise self.error("limit_exceeded", name, f"has more than {max_items} items")
        if len(value) < min_items:
            raise self.error("invalid_field", name, f"must have at least {min_items} item(s)")
        return value

    def token_ids(
        self, name: str, *, required: bool = False, max_items: int, min_items: int = 0
    ) -> tuple[int, ...] | None:
        items = self.array(name, required=required, max_items=max_items, min_items=min_items)
        if items is None:
            return None
        if not all(is_integer(item) and item >= 0 for item in items):
            raise self.error("invalid_field", name, "must hold non-negative integers")
        return tuple(items)

    def mapping(self, name: str, *, required: bool = False) -> dict[str, Any] | None:
        value = self._value(name, required)
        if value is _ABSENT:
            return None
        if not isinstance(value, dict):
            raise self.error("invalid_field", name, "must be a map")
        return value

    def metadata(self, name: str) -> dict[str, Any] | None:
        """A producer's free-form map, echoed back: JSON-like, bounded in size and depth."""
        value = self.json_map(name)
        if value is not None:
            size = len(msgpack.packb(value, use_bin_type=True))
            if size > self.limits.max_metadata_bytes:
                raise self.error(
                    "limit_exceeded", name, f"is over {self.limits.max_metadata_bytes} bytes packed"
                )
        return value

    def json_map(self, name: str, *, required: bool = False) -> dict[str, Any] | None:
        """A map of JSON-like values (so any consumer can print it), bounded in depth."""
        value = self.mapping(name, required=required)
        if value is None:
            return None
        problem = json_like_problem(value, self.limits.max_metadata_depth)
        if problem is not None:
            code = "limit_exceeded" if problem == _TOO_DEEP else "invalid_field"
            raise self.error(code, name, problem)
        return value


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        # Integers too large for a float would overflow float(); they are no sane parameter.
        return abs(value) <= 2**53
    return isinstance(value, float) and math.isfinite(value)


# Values that are JSON-like whatever they hold (a float may be NaN: not one of them).
_PLAIN_SCALARS: Final = frozenset({str, int, bool, type(None)})


def json_like_problem(value: object, depth_left: int) -> str | None:
    """Why ``value`` is not JSON-like within ``depth_left`` levels of nesting, or None.

    Recursion stops at the depth limit, so hostile nesting can't exhaust the stack. Plain
    scalars in a map or array are passed over without a call: a broadcast's thousand stats
    replies are mostly numbers, and checking them was most of the sender's time.
    """
    if isinstance(value, dict | list):
        if depth_left <= 0:
            return _TOO_DEEP
        if isinstance(value, dict):
            for key in value:
                if type(key) is not str and not isinstance(key, str):
                    return "must have string keys only"
            children: Any = value.values()
        else:
            children = value
        for child in children:
            if type(child) in _PLAIN_SCALARS:
                continue
            problem = json_like_problem(child, depth_left - 1)
            if problem is not None:
                return problem
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "must not contain NaN or infinities"
    if value is None or isinstance(value, str | bool | int | float):
        return None
    return "must hold only maps, arrays, strings, numbers, booleans and nil"
