"""A deterministic suite of varied JSON schemas for ``mlx-worker bench structured``.

Seeded random shapes: objects nested up to depth 3, arrays with ``minItems``/``maxItems``,
string enums, integers and numbers with ``minimum``/``maximum``, strings with ``maxLength``,
booleans, optional and required fields, and ``anyOf``. Every object sets
``additionalProperties: false`` and every string and array is bounded, so an output always has
an end; a schema whose longest instance would not fit a small model's budget is regenerated.
Each schema comes with a one-line description (built from its property names) for the prompt.
A schema llguidance refuses (``accepts`` false) is dropped and counted.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import jsonschema

Schema = dict[str, Any]

TOPICS: Final = (
    "book", "city", "product", "user", "order", "recipe", "movie", "song", "car", "team",
    "event", "device", "invoice", "pet", "course",
)  # fmt: skip
NAMES: Final = (
    "name", "title", "city", "color", "count", "price", "score", "tags", "owner", "status",
    "level", "rating", "year", "size", "weight", "label", "kind", "notes", "author", "items",
    "stock", "active", "region", "code", "speed", "parts", "email", "phone", "country", "mode",
)  # fmt: skip
ENUM_WORDS: Final = (
    "red", "green", "blue", "small", "medium", "large", "open", "closed", "new", "used",
    "low", "high", "draft", "done",
)  # fmt: skip
SCALARS: Final = ("string", "integer", "number", "boolean", "enum")
# The longest instance a schema may have (``instance_chars``): a 256-token budget holds it
# at ~1.3 characters per token; SmolLM2 writes JSON at 2–4.
MAX_INSTANCE_CHARS: Final = 320


@dataclass(frozen=True, slots=True)
class SuiteSchema:
    index: int
    schema: Schema
    description: str


@dataclass(slots=True)
class Suite:
    schemas: list[SuiteSchema]
    refused: int  # generated, then dropped because llguidance refused them
    oversized: int  # regenerated: the longest instance exceeded MAX_INSTANCE_CHARS


def _value(rng: random.Random, depth: int) -> Schema:
    kinds = list(SCALARS) * 2 + (["array", "object", "anyOf"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 30)}
    if kind == "integer":
        low = rng.randint(-50, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 5000)}
    if kind == "number":
        bottom = round(rng.uniform(-20, 50), 1)
        top = round(bottom + rng.uniform(1, 500), 1)
        return {"type": "number", "minimum": bottom, "maximum": top}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(ENUM_WORDS, rng.randint(2, 5))}
    if kind == "array":
        low = rng.randint(0, 2)
        items = _value(rng, depth + 1 if rng.random() < 0.3 else 3)  # mostly scalars
        return {
            "type": "array",
            "items": items,
            "minItems": low,
            "maxItems": low + rng.randint(1, 3),
        }
    if kind == "object":
        return _object(rng, depth + 1, rng.randint(1, 3))
    branches = [_value(rng, 3), {"type": "null"}, _object(rng, depth + 1, rng.randint(1, 2))]
    return {"anyOf": rng.sample(branches, 2)}


def _object(rng: random.Random, depth: int, size: int) -> Schema:
    names = rng.sample(NAMES, size)
    properties = {name: _value(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema


def instance_chars(schema: Schema) -> int:
    """The length of the longest compact instance (``", "`` and ``": "`` separators), strings
    at ``maxLength`` plain characters and numbers at 24 (bounds do not bound decimals)."""
    if "anyOf" in schema:
        return max(instance_chars(branch) for branch in schema["anyOf"])
    if "enum" in schema:
        return max(len(word) + 2 for word in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + int(schema["maxLength"])
    if kind in ("integer", "number"):
        return 24
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        return 2 + int(schema["maxItems"]) * (instance_chars(schema["items"]) + 2)
    fields = schema["properties"].items()
    return 2 + sum(len(name) + 6 + instance_chars(value) for name, value in fields)


def _phrase(schema: Schema) -> str:
    if "anyOf" in schema:
        return " or ".join(_phrase(branch) for branch in schema["anyOf"])
    if "enum" in schema:
        return "one of " + "/".join(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return f"text up to {schema['maxLength']} characters"
    if kind == "integer":
        return f"whole number {schema['minimum']} to {schema['maximum']}"
    if kind == "number":
        return f"number {schema['minimum']} to {schema['maximum']}"
    if kind == "boolean":
        return "true or false"
    if kind == "null":
        return "null"
    if kind == "array":
        return f"list of {schema['minItems']}–{schema['maxItems']} ({_phrase(schema['items'])})"
    required = set(schema.get("required", ()))
    fields = [
        f"{name}{'' if name in required else ' (optional)'}: {_phrase(value)}"
        for name, value in schema["properties"].items()
    ]
    return "object with " + "; ".join(fields)


def describe(schema: Schema, topic: str) -> str:
    """One line for the prompt: the topic and every field, nested ones in brackets."""
    return f"Describe a {topic} as a JSON {_phrase(schema)}.".replace("\n", " ")


def build_suite(
    count: int, accepts: Callable[[Schema], bool], seed: int = 0, max_fields: int = 5
) -> Suite:
    """``count`` schemas that ``accepts`` (the grammar engine's check) takes, in a fixed order."""
    rng = random.Random(seed)
    schemas: list[SuiteSchema] = []
    refused = oversized = 0
    while len(schemas) < count:
        schema = _object(rng, 1, rng.randint(1, max_fields))
        if instance_chars(schema) > MAX_INSTANCE_CHARS:
            oversized += 1
            continue
        if not accepts(schema):
            refused += 1
            continue
        topic = TOPICS[len(schemas) % len(TOPICS)]
        schemas.append(SuiteSchema(len(schemas), schema, describe(schema, topic)))
    return Suite(schemas, refused, oversized)


def validation_error(schema: Schema, text: str) -> str:
    """Why ``text`` is no instance of ``schema`` (jsonschema's best match, draft 2020-12);
    "" when it is one."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(instance)
    )
    return "" if error is None else f"{error.message} at {list(error.absolute_path)}"


def llguidance_accepts(schema: Schema) -> bool:
    """Whether llguidance compiles ``schema`` without error or warning (no tokenizer needed:
    the engine's own check then passes as well; ``mlx_redis_worker.engine.structured``)."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema)
    except ValueError:
        return False
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return not is_error and not messages
