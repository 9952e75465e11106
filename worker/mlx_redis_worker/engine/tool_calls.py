"""Tool calling in each model's own syntax: which syntax, the prompt, and the grammar.

A model whose chat template renders tools gets them from the template
(``apply_chat_template(..., tools=...)``) and is read in the syntax it was trained on, chosen
from what mlx-lm infers from the template (or the model's own ``tool_parser_type`` setting):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block a
  call (Hermes, Qwen 2.5/3);
- ``llama3_json``: the answer is one ``{"name": ..., "parameters": {...}}`` (Llama 3.x);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A model whose template knows no tools (or another syntax) gets the fallback: the tools are
described in the system turn and the model is asked for hermes blocks, which is also how it
is read. Calls the model made earlier in a chat are rendered the same way.

Every call is generated under an llguidance grammar (a Lark grammar with each function's
schema inlined as ``%json``): with ``required`` or a named function the answer is calls only;
with ``auto`` it is lazy, free text until the model opens a call, constrained from there.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from mlx_redis_protocol.messages import Tool, ToolChoice

SyntaxName = Literal["hermes", "llama3_json", "mistral"]

# Compact JSON, as for response_format (a small model wanders in flexible whitespace).
_JSON_OPTIONS: Final = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY_TEXT: Final = "/(?s:.*)/"


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """How a model writes calls: ``start`` opens a call region, ``end`` closes it ("" for
    the end of the answer); a region holds one call object, or an array of them
    (``array``); the arguments are under ``arguments_key``. ``native``: the chat template
    renders the tools itself (else the fallback prompt describes them)."""

    name: SyntaxName
    start: str
    end: str
    arguments_key: str = "arguments"
    array: bool = False
    native: bool = True
    # The length of the call ids the model's templates accept (0: any id).
    id_chars: int = 0
    # The model's templates take one call an assistant turn (Llama 3.x's raise on more).
    one_call_a_turn: bool = False


HERMES: Final = ToolSyntax("hermes", "<tool_call>\n", "\n</tool_call>")
LLAMA3_JSON: Final = ToolSyntax(
    "llama3_json", "", "", arguments_key="parameters", one_call_a_turn=True
)
# Mistral's templates refuse a call id that is not 9 letters and digits (v3 and Tekken alike).
MISTRAL: Final = ToolSyntax("mistral", "[TOOL_CALLS]", "", array=True, id_chars=9)
FALLBACK: Final = ToolSyntax("hermes", "<tool_call>\n", "\n</tool_call>", native=False)

# mlx-lm's parser modules for the syntaxes above.
_PARSERS: Final = {"json_tools": HERMES, "mistral": MISTRAL}


def tool_syntax(tokenizer: Any) -> ToolSyntax:
    """The syntax of the model's calls (see the module's doc)."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    known = _PARSERS.get(module.rsplit(".", 1)[-1])
    if known is not None:
        return known
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "tools" in template and "<|python_tag|>" in template:
        return LLAMA3_JSON
    return FALLBACK


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description or "",
                "parameters": dict(tool.parameters or {"type": "object", "properties": {}}),
            },
        }
        for tool in tools
    ]


def template_turns(messages: list[dict[str, Any]], syntax: ToolSyntax) -> list[dict[str, Any]]:
    """``messages`` in the shape the model's templates take: call ids they accept
    (:func:`with_call_ids`) and, for a model that takes one call a turn, an assistant turn
    of several calls split into one turn a call, each followed by its result."""
    turns = with_call_ids(messages, syntax)
    return _one_call_a_turn(turns) if syntax.one_call_a_turn else turns


def _one_call_a_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    at = 0
    while at < len(messages):
        turn = messages[at]
        calls = turn.get("tool_calls") or []
        at += 1
        if len(calls) < 2:
            turns.append(turn)
            continue
        results = []
        while at < len(messages) and messages[at]["role"] == "tool":
            results.append(messages[at])
            at += 1
        for index, call in enumerate(calls):
            content = turn["content"] if index == 0 else ""
            turns.append({**turn, "content": content, "tool_calls": [call]})
            turns += [r for r in results if r.get("tool_call_id") == call.get("id")]
        ids = {call.get("id") for call in calls}
        turns += [r for r in results if r.get("tool_call_id") not in ids]
    return turns


def with_call_ids(messages: list[dict[str, Any]], syntax: ToolSyntax) -> list[dict[str, Any]]:
    """``messages`` with each call id (and each tool turn's ``tool_call_id``) in the shape the
    model's template accepts: an id it would refuse becomes a stable one of its shape (the
    same id always gives the same, so a call and its result stay paired)."""
    if not syntax.id_chars:
        return messages
    turns = []
    for turn in messages:
        turn = dict(turn)
        if turn.get("tool_calls"):
            turn["tool_calls"] = [
                {**call, "id": _short_id(str(call.get("id", "")), syntax.id_chars)}
                for call in turn["tool_calls"]
            ]
        if "tool_call_id" in turn:
            turn["tool_call_id"] = _short_id(str(turn["tool_call_id"]), syntax.id_chars)
        turns.append(turn)
    return turns


_ID_ALPHABET: Final = string.ascii_letters + string.digits


def _short_id(call_id: str, chars: int) -> str:
    if len(call_id) == chars and all(c in _ID_ALPHABET for c in call_id):
        return call_id
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
    letters = []
    for _ in range(chars):
        number, digit = divmod(number, len(_ID_ALPHABET))
        letters.append(_ID_ALPHABET[digit])
    return "".join(letters)


# -- the fallback prompt ---------------------------------------------------------------------

_FALLBACK_INSTRUCTIONS: Final = (
    "You can call functions. Their JSON Schemas are listed below, one per line.\n"
    "To call one, answer with exactly:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments as JSON>}}\n</tool_call>\n'
    "Functions:\n{functions}"
)


def fallback_messages(
    messages: list[dict[str, Any]], tools: Sequence[Tool] | None
) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support: the tools described at the end of
    the system turn (one is added when there is none), earlier calls written as the model is
    asked to write them, and tool results as user turns."""
    turns: list[dict[str, Any]] = []
    for turn in messages:
        if turn["role"] == "tool":
            turns.append(
                {
                    "role": "user",
                    "content": f"<tool_response>\n{turn['content']}\n</tool_response>",
                }
            )
        elif turn.get("tool_calls"):
            calls = "\n".join(_hermes_call(call["function"]) for call in turn["tool_calls"])
            text = f"{turn['content']}\n{calls}" if turn["content"] else calls
            turns.append({"role": turn["role"], "content": text})
        else:
            turns.append({"role": turn["role"], "content": turn["content"]})
    if tools:
        functions = "\n".join(json.dumps(t["function"]) for t in template_tools(tools))
        described = _FALLBACK_INSTRUCTIONS.format(functions=functions)
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{described}"}
        else:
            turns.insert(0, {"role": "system", "content": described})
    return turns


def _hermes_call(function: dict[str, Any]) -> str:
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


# -- grammars --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Markers:
    """Lark spellings of the model's markers: a special token as ``<[id]>`` (text cannot
    match it), anything else as a string literal."""

    special: dict[str, int]

    @classmethod
    def of(cls, tokenizer: Any) -> Markers:
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        return cls({t.content: i for i, t in decoder.items() if getattr(t, "special", False)})

    def literal(self, text: str) -> str:
        token = self.special.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    def text_without(self, name: str, text: str) -> str:
        """A terminal ``name`` matching any text that does not hold ``text``."""
        if text in self.special:
            return f"{name}: {_ANY_TEXT}"
        inner = _regex_escape(text)
        return f"{name}: {_ANY_TEXT} & ~/(?s:.*){inner}(?s:.*)/"


def tool_grammar(
    syntax: ToolSyntax,
    tools: Sequence[Tool],
    choice: ToolChoice | None,
    *,
    parallel: bool,
    markers: Markers,
    thought: tuple[str, str] | None = None,
    thought_open: bool = False,
) -> str:
    """The Lark grammar of an answer: calls only for ``required`` or a named function, free
    text or calls for ``auto``. ``thought`` (the model's think markers) lets a reasoning
    model think first (its opening marker already in the prompt when ``thought_open``)."""
    mode = choice.mode if choice is not None else "auto"
    # A named function is called once (as vLLM's named tool choice does): forced to call it,
    # a small model would otherwise repeat the call until max_tokens.
    parallel = parallel and mode != "function"
    allowed = [t for t in tools if mode != "function" or t.name == (choice and choice.name)]
    schema = _call_schema(syntax, allowed)
    if syntax.array:
        schema = {"type": "array", "items": schema, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
    lines = [f"fn: %json {json.dumps({**schema, 'x-guidance': _JSON_OPTIONS})}"]
    start, end = markers.literal(syntax.start), syntax.end
    if syntax.array or not syntax.start:
        # One region holds every call: mistral's array, llama's single object.
        # Mistral's v3 templates write a blank after the marker, Tekken's none: either.
        calls = f'{start} " "? fn' if syntax.start else "fn"
        lines.append(f"calls: {calls}")
    else:
        body = f"fn {markers.literal(end)}" if end else "fn"
        lines.append(f"call: {start} {body}")
        # A model may end its last block's line before it ends the answer: a line break
        # after a call must not oblige it to write one more.
        more = ' ("\\n" call)*' if parallel else ""
        lines.append(f'calls: call{more} "\\n"?')
    if mode == "auto":
        lines += _auto_rules(syntax, markers, parallel)
    else:
        lines.append("answer: calls")
    lines += _thought_rules(thought, thought_open, markers)
    return "\n".join(lines) + "\n"


def _auto_rules(syntax: ToolSyntax, markers: Markers, parallel: bool) -> list[str]:
    if not syntax.start:  # llama: a call is the whole answer; text must not open like one
        return ["answer: TEXT | calls", "TEXT: /[^{](?s:.*)/"]
    marker = syntax.start.rstrip("\n") if not syntax.array else syntax.start
    rules = ["answer: TEXT | calls", markers.text_without("TEXT", marker)]
    if marker not in markers.special and not syntax.array:
        # Text, then calls: the text ends where a call opens (lazy), constrained from there.
        rest = syntax.start[len(marker) :]
        body = f"fn {markers.literal(syntax.end)}" if syntax.end else "fn"
        rules[0] = "answer: TEXT | calls | led"
        more = ' ("\\n" call)*' if parallel else ""
        rules.append(f'led: lead {json.dumps(rest)} {body}{more} "\\n"?')
        rules.append(f"lead[lazy]: TEXT {json.dumps(marker)}")
    return rules


def _thought_rules(
    thought: tuple[str, str] | None, thought_open: bool, markers: Markers
) -> list[str]:
    if thought is None:
        return ["start: answer"]
    open_marker, close_marker = thought
    # Lazy: the thought ends at its first closing marker (a greedy lexeme would not stop).
    rules = [
        markers.text_without("THOUGHT", close_marker),
        f"think[lazy]: THOUGHT {markers.literal(close_marker)}",
        "GAP: /[ \\t\\n]*/",
    ]
    if thought_open:
        return ["start: think GAP answer", *rules]
    return [f"start: ({markers.literal(open_marker)} think GAP)? answer", *rules]


def _call_schema(syntax: ToolSyntax, tools: Sequence[Tool]) -> dict[str, Any]:
    """The JSON Schema of one call object (name first, so a stream can name the call before
    its arguments)."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.name},
                syntax.arguments_key: closed(dict(tool.parameters or {"type": "object"})),
            },
            "required": ["name", syntax.arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties and says nothing of others
    closed to them (``additionalProperties: false``), as OpenAI's strict mode has it: a model
    left free to add keys of its own writes on until ``max_tokens``, and each call made this
    way still validates against the schema as given."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {
        key: closed(value) if key not in ("const", "enum", "default", "examples") else value
        for key, value in schema.items()
    }
    if "properties" in schema and "additionalProperties" not in schema:
        result["additionalProperties"] = False
    return result


def _regex_escape(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` (``\\<`` would be a word boundary)."""
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


_REGEX_META: Final = frozenset("\\.+*?()|[]{}^$#&-~/")
