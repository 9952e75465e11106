"""Hostile JSON schemas: the costliest kinds a tenant can send inside the wire's limits.

Each is valid JSON Schema that llguidance accepts, stays within ``max_schema_depth``,
``max_map_len``, ``max_array_len`` and ``max_message_bytes``, and is as expensive as its kind
can make it: a deep and wide ``anyOf`` tree (compile and matcher build), long ``enum`` lists
(lexer size), large bounded repeats (``minLength``/``maxLength``, ``minItems``/``maxItems``,
``{m,n}`` in patterns: mask cost). ``salt`` makes each call a new schema (a new cache key),
so an attacker's requests can defeat the compiled-grammar cache or share one entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

Schema = dict[str, Any]

KINDS: Final = ("deep_anyof", "nested_anyof", "long_enum", "bounded_repeat", "mixed")


def deep_anyof(salt: str = "", width: int = 16, depth: int = 3) -> Schema:
    """``width`` object branches per level, ``depth`` levels: width**depth leaves, each
    branch with its own bounded integer and patterned string."""

    def level(path: str, left: int) -> Schema:
        branches = []
        for i in range(width):
            name = f"{salt}{path}{i}"
            properties: Schema = {
                f"n{name}": {"type": "integer", "minimum": i, "maximum": 1000 + i},
                f"s{name}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},{i + 9}}}{i}$"},
            }
            if left > 1:
                properties[f"c{name}"] = level(f"{path}{i}_", left - 1)
            branches.append(
                {
                    "type": "object",
                    "properties": properties,
                    "required": list(properties),
                    "additionalProperties": False,
                }
            )
        return {"anyOf": branches}

    return level("", depth)


def nested_anyof(salt: str = "", width: int = 6, depth: int = 4) -> Schema:
    """``anyOf`` nested ``depth`` levels deep, ``width`` branches each: objects of one property
    down to the last level, whose branches are patterned strings (named after their path) and
    bounded integers. 6 x 4 with a salt of 14 characters is about 112 KiB, under the default
    max_schema_bytes (128 KiB): 1,296 leaves the grammar keeps alive at once."""

    def level(path: str, left: int) -> Schema:
        branches: list[Schema] = []
        for i in range(width):
            name = f"{salt}{path}{i}"
            if left > 1:
                inner = {f"k{name}": level(f"{path}{i}", left - 1)}
                branches.append(
                    {
                        "type": "object",
                        "properties": inner,
                        "required": list(inner),
                        "additionalProperties": False,
                    }
                )
            elif i % 2:
                pattern = f"^{name}[a-z]{{{i % 5 + 1},{i + 9}}}[0-9]{{1,{i}}}$"
                branches.append({"type": "string", "pattern": pattern})
            else:
                branches.append({"type": "integer", "minimum": i, "maximum": 10**7 + i})
        return {"anyOf": branches}

    return level("", depth)


def long_enum(salt: str = "", values: int = 20_000) -> Schema:
    """One property whose value is one of ``values`` strings sharing long prefixes."""
    return {
        "type": "object",
        "properties": {
            "choice": {"enum": [f"{salt}option-{i:06d}-{'x' * (i % 17)}" for i in range(values)]}
        },
        "required": ["choice"],
        "additionalProperties": False,
    }


def bounded_repeat(salt: str = "", count: int = 4000) -> Schema:
    """Strings and arrays of exactly ``count`` items, and patterns with large {m,n}."""
    return {
        "type": "object",
        "properties": {
            "text": {"type": "string", "minLength": count, "maxLength": count},
            "code": {"type": "string", "pattern": f"^({salt or 'a'}[0-9]{{1,{count}}}-){{1,64}}$"},
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": count,
                "maxItems": count,
            },
        },
        "required": ["text", "code", "items"],
        "additionalProperties": False,
    }


def mixed(salt: str = "") -> Schema:
    """All three kinds under one ``anyOf``: a few hundred KB, inside every wire limit."""
    return {
        "anyOf": [
            deep_anyof(salt, width=12, depth=3),
            long_enum(salt, values=8000),
            bounded_repeat(salt, count=2000),
        ]
    }


def hostile_schema(kind: str, salt: str = "") -> Schema:
    """A schema of ``kind`` (one of ``KINDS``) at its default size."""
    builders: dict[str, Callable[[str], Schema]] = {
        "deep_anyof": deep_anyof,
        "nested_anyof": nested_anyof,
        "long_enum": long_enum,
        "bounded_repeat": bounded_repeat,
        "mixed": mixed,
    }
    if kind not in builders:
        raise ValueError(f"hostile schema kind must be one of {KINDS}, got {kind!r}")
    return builders[kind](salt)


def schema_bytes(schema: Schema) -> int:
    """The schema as compact JSON, as the engine counts it against ``max_schema_bytes``."""
    return len(json.dumps(schema, separators=(",", ":")).encode())
