"""A JSON schema for tests of structured output through a worker."""

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
