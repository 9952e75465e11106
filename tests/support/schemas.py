"""JSON schemas for tests of structured output and tool calls through a worker."""

from __future__ import annotations

from typing import Any

# Enums, a bounded integer and a boolean: a few tokens, so even the tiny random model ends a
# match by the grammar's own end well within a few dozen tokens.
SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}

# Two functions' parameters for tool-call tests: a call to either is a few tokens long.
LIGHT: dict[str, Any] = {
    "type": "object",
    "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
    "required": ["room", "on"],
    "additionalProperties": False,
}
HEAT: dict[str, Any] = {
    "type": "object",
    "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 5}},
    "required": ["level"],
    "additionalProperties": False,
}
TOOL_SCHEMAS = {"set_light": LIGHT, "set_heat": HEAT}
