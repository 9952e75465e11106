"""Splitting a request's streamed text into content, reasoning and tool calls.

A reasoning model's thought (between its think markers) streams as ``reasoning``; a call the
model makes in its tool syntax (:mod:`mlx_redis_worker.engine.tool_calls`) streams as pieces:
the call's id and name once the name is read, then its arguments' JSON text as it is
generated, so a client can show a call while it is written. Everything else is ``content``.
Text that may be the start of a marker is held back until it is known not to be, as stop
strings are. Pure text processing: no MLX, no Redis.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Final

from mlx_redis_protocol.messages import ToolCall, ToolCallDelta
from mlx_redis_worker.engine.tool_calls import ToolSyntax

# A call object that names its function first, as the grammar has it (and models write it).
_HEADER: Final = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(\w+)"\s*:\s*')
_DECODER: Final = json.JSONDecoder()


def _prefix_pattern(units: list[str]) -> re.Pattern[str]:
    """A pattern matching every prefix of the sequence ``units`` (each one regex piece)."""
    pattern = ""
    for unit in reversed(units):
        pattern = f"{unit}(?:{pattern})?" if pattern else unit
    return re.compile(f"(?:{pattern})\\Z")


_HEADER_UNITS = ["\\{", "\\s*", '"', "n", "a", "m", "e", '"', "\\s*", ":", "\\s*", '"']
_HEADER_UNITS += ["[A-Za-z0-9_-]{0,64}", '"', "\\s*", ",", "\\s*", '"', "\\w*", '"', "\\s*", ":"]
_HEADER_PREFIX: Final = _prefix_pattern(_HEADER_UNITS)
del _HEADER_UNITS


@dataclass(slots=True)
class Split:
    """What one piece of text turned out to be."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: Split) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    """One request's splitter. ``thought``: the model's think markers (None: it does not
    reason); ``thought_open``: the prompt opened the thought already; ``syntax``: the tool
    syntax to read (None: the job offers no tools)."""

    def __init__(
        self,
        *,
        syntax: ToolSyntax | None = None,
        thought: tuple[str, str] | None = None,
        thought_open: bool = False,
    ) -> None:
        self.syntax = syntax
        self.thought = thought
        self._state = "reasoning" if thought is not None and thought_open else "start"
        self._buffer = ""
        self._region_open: _CallRegion | None = None
        self.content = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []
        self._next_index = 0

    def feed(self, text: str) -> Split:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> Split:
        """The rest, at the end of the output (held-back text is content after all)."""
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> Split:
        split = Split()
        steps = {
            "start": self._start,
            "reasoning": self._reasoning,
            "answer": self._answer,
            "content": self._content,
            "region": self._region,
        }
        while steps[self._state](split, final):
            pass
        self.content += split.content
        self.reasoning += split.reasoning
        return split

    # Each state's step: True when it moved on (to run the next state on what is left).

    def _start(self, split: Split, final: bool) -> bool:
        text = self._buffer.lstrip()
        if self.thought is not None:
            opening = self.thought[0]
            if text.startswith(opening):
                self._buffer = text[len(opening) :]
                self._state = "reasoning"
                return True
            if opening.startswith(text) and not final:
                return False  # maybe the opening marker, still arriving
        self._state = "answer"
        return True

    def _reasoning(self, split: Split, final: bool) -> bool:
        assert self.thought is not None
        closing = self.thought[1]
        at = self._buffer.find(closing)
        if at >= 0:
            split.reasoning += self._buffer[:at]
            self._buffer = self._buffer[at + len(closing) :]
            self._state = "answer"
            return True
        keep = 0 if final else _held(self._buffer, closing)
        split.reasoning += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _answer(self, split: Split, final: bool) -> bool:
        """The start of the answer: blanks after a thought are dropped; a llama-style call
        is the whole answer, so it is known by its first character."""
        text = self._buffer.lstrip()
        if not text and not final:
            return False
        self._buffer = text
        if self.syntax is not None and not self.syntax.start and text.startswith("{"):
            self._open_call(final)
            return True
        self._state = "content"
        return True

    def _content(self, split: Split, final: bool) -> bool:
        marker = self.syntax.start.strip() if self.syntax is not None else ""
        if marker:
            at = self._buffer.find(marker)
            if at >= 0:
                split.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(marker) :]
                self._open_call(final)
                return True
        keep = _held(self._buffer, marker) if marker and not final else 0
        split.content += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _open_call(self, final: bool) -> None:
        assert self.syntax is not None
        self._region_open = _CallRegion(self.syntax, self._next_index)
        self._state = "region"

    def _region(self, split: Split, final: bool) -> bool:
        region = self._region_open
        assert region is not None
        region.text += self._buffer
        self._buffer = ""
        done, deltas = region.advance(final)
        split.tool_calls += deltas
        if not done:
            return False
        self._next_index = region.index
        self.calls += region.calls
        if region.broken and not region.calls and not region.emitted:
            # Nothing of it read as a call: what the model wrote is its answer.
            split.content += self.syntax.start.strip() if self.syntax else ""
            split.content += region.text[: region.rest_at]
        self._buffer = region.text[region.rest_at :]
        self._region_open = None
        self._state = "answer"  # blanks between calls are no answer
        return True


def _held(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class _CallRegion:
    """The text of one call region (after its opening marker), read as it grows."""

    def __init__(self, syntax: ToolSyntax, index: int) -> None:
        self.syntax = syntax
        self.index = index
        self.text = ""
        self.calls: list[ToolCall] = []
        self.emitted = False  # a piece of a call went out
        self.broken = False  # not in the expected shape: read whole at the end
        self.end_at = 0  # where the region's own text ends
        self.rest_at = 0  # where the text after it (its end marker skipped) begins
        self._pos = 0
        self._object_at: int | None = None
        self._call: tuple[str, str] | None = None  # (id, name) of the call being read
        self._args_at = 0
        self._scanned = 0
        self._scan = _JsonScan()

    def advance(self, final: bool) -> tuple[bool, list[ToolCallDelta]]:
        """Read what arrived; (the region ended, the pieces of calls it made)."""
        deltas: list[ToolCallDelta] = []
        while not self.broken:
            if self._call is not None:
                if not self._arguments(deltas):
                    break
                continue
            step = self._between(deltas)
            if step == "wait":
                break
            if step == "end":
                return True, deltas
        if self.broken:
            end = self._end_marker_at()
            if end is None and not final:
                return False, deltas
            self._finish_broken(deltas, end)
            return True, deltas
        if final:
            self.broken = True
            self._finish_broken(deltas, None)
            return True, deltas
        return False, deltas

    def _between(self, deltas: list[ToolCallDelta]) -> str:
        """Between calls: blanks and separators, the next call's header, or the end."""
        text, pos = self.text, self._pos
        while pos < len(text) and (
            text[pos].isspace() or (self.syntax.array and text[pos] in "[,")
        ):
            pos += 1
        self._pos = pos
        end = self.syntax.end.strip()
        rest = text[pos:]
        if not rest:
            return "wait"
        if end and rest.startswith(end):
            self._close(pos, pos + len(end))
            return "end"
        if end and end.startswith(rest):
            return "wait"
        if self.syntax.array and rest.startswith("]"):
            self._close(pos, pos + 1)
            return "end"
        if not rest.startswith("{"):
            if self.calls:  # text after the calls: the answer goes on
                self._close(pos, pos)
                return "end"
            self.broken = True
            return "wait"
        header = _HEADER.match(text, pos)
        if header is None:
            if _HEADER_PREFIX.match(rest) is None:
                self.broken = True  # not name first: read it whole at the end
            return "wait"
        if header.group(2) != self.syntax.arguments_key:
            self.broken = True
            return "wait"
        self._object_at = pos
        self._call = (new_call_id(), header.group(1))
        self._args_at = self._scanned = header.end()
        self._scan = _JsonScan()
        deltas.append(ToolCallDelta(self.index, id=self._call[0], name=self._call[1]))
        self.emitted = True
        return "call"

    def _arguments(self, deltas: list[ToolCallDelta]) -> bool:
        """Stream the arguments' text; True once the call object is whole."""
        assert self._call is not None
        text = self.text
        if not self._scan.started:  # blanks before the value are not part of it
            while self._scanned < len(text) and text[self._scanned].isspace():
                self._scanned += 1
            self._args_at = self._scanned
        stop = self._scan.feed(text, self._scanned)
        if stop > self._scanned:
            deltas.append(ToolCallDelta(self.index, arguments=text[self._scanned : stop]))
            self._scanned = stop
        if not self._scan.complete:
            return False
        after = text[stop:].lstrip()
        if not after:
            return False
        if not after.startswith("}"):
            self.broken = True
            return False
        arguments = text[self._args_at : stop]
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            self.broken = True
            return False
        call_id, name = self._call
        self.calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
        self.index += 1
        self._call = None
        self._pos = len(text) - len(after) + 1
        return True

    def _end_marker_at(self) -> int | None:
        end = self.syntax.end.strip()
        if not end:
            return None
        at = self.text.find(end, self._pos)
        return at if at >= 0 else None

    def _close(self, end_at: int, rest_at: int) -> None:
        self.end_at, self.rest_at = end_at, rest_at

    def _finish_broken(self, deltas: list[ToolCallDelta], end: int | None) -> None:
        """Read what is left of the region whole: each call object in it that parses."""
        stop = len(self.text) if end is None else end
        self._close(stop, stop + len(self.syntax.end.strip()) if end is not None else stop)
        if self._call is not None:  # a call cut short (max_tokens): it never completed
            self._call = None
            return
        body = self.text[self._pos : stop].strip()
        for item in _json_objects(body, self.syntax.array):
            name = item.get("name")
            arguments = item.get(self.syntax.arguments_key, item.get("arguments"))
            if not isinstance(name, str) or not isinstance(arguments, dict):
                continue
            call = ToolCall(id=new_call_id(), name=name, arguments=json.dumps(arguments))
            deltas.append(ToolCallDelta(self.index, call.id, call.name, call.arguments))
            self.calls.append(call)
            self.index += 1


def _json_objects(body: str, array: bool) -> list[dict[str, object]]:
    try:
        value, _ = _DECODER.raw_decode(body)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    return [item for item in items if isinstance(item, dict)]


class _JsonScan:
    """Finds where one JSON value ends in a growing text, one character at a time."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.complete = False

    def feed(self, text: str, start: int) -> int:
        """Scan ``text`` from ``start``; the index after the last character of the value."""
        pos = start
        while pos < len(text) and not self.complete:
            char = text[pos]
            pos += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    self.complete = self.depth == 0
                continue
            if char == '"':
                self.in_string, self.started = True, True
            elif char in "{[":
                self.depth += 1
                self.started = True
            elif char in "}]":
                self.depth -= 1
                self.complete = self.depth <= 0
            elif not char.isspace():
                self.started = True
        return pos
