"""Incremental text for one request: streaming detokenization plus stop strings.

Text comes from the tokenizer's own streaming detokenizer (mlx-lm's; for byte-level BPE the
same with each token's bytes cached, ``CachedBPEDetokenizer``). Stop strings are matched on
text with mlx-lm's ``TextStateMachine``: text that might be the start of a stop string is held
back until it is known not to be, so a stop string never leaks into the output, even when it is
split across tokens.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import TextStateMachine
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

# A token's entry in ``CachedBPEDetokenizer``'s table: its string in GPT-2's byte alphabet,
# the bytes mlx-lm's detokenizer turns that string into, and whether it is a lone space (held
# back until the next token, as mlx-lm does).
TokenText = tuple[str, bytes, bool]


class CachedBPEDetokenizer(BPEStreamingDetokenizer):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's byte-level BPE streaming detokenizer with each token's bytes looked up instead
    of decoded character by character on every token. That decoding was most of the
    detokenizer's time: 128 streams of 96 tokens (CPU) took 1.2-1.4 µs a token through
    ``TextStream`` with mlx-lm's, 0.7 with this one. The text is the same, segment for segment:
    the same bytes, decoded and flushed by the same rules; ``finalize`` is mlx-lm's. ``table``
    is shared by every request of one tokenizer and filled as tokens first appear (engine
    thread only)."""

    _unflushed: str
    text: str
    tokens: list[int]

    def __init__(self, base: BPEStreamingDetokenizer, table: dict[int, TokenText]) -> None:
        # Not mlx-lm's __init__: it would rebuild the vocabulary's token map.
        self.tokenmap = base.tokenmap
        self._table = table
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._pending = bytearray()  # the bytes of ``_unflushed``

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        entry = self._table.get(token)
        if entry is None:
            entry = self._table[token] = self._entry(token)
        string, raw, lone_space = entry
        self._unflushed += string
        self._pending += raw
        text = self._pending.decode("utf-8", "replace")
        # As mlx-lm: wait while a multi-byte character is incomplete, or after a lone space.
        if not text.endswith("\ufffd") and not lone_space:
            self.text += self._maybe_trim_space(text)
            self._unflushed = ""
            self._pending.clear()

    def finalize(self) -> None:
        super().finalize()
        self._pending.clear()

    def _entry(self, token: int) -> TokenText:
        tokenmap = self.tokenmap
        # mlx-lm's fallback for an id past the token map (a padded vocabulary).
        string: str = tokenmap[token] if token < len(tokenmap) else "!"
        decoder = _byte_decoder()
        # mlx-lm's _decode_bytes, one character at a time (a character without a byte, or
        # the one for byte 0, goes in as its UTF-8).
        raw = bytearray()
        for char in string:
            byte = decoder.get(char, False)
            if byte:
                raw.append(byte)
            else:
                raw.extend(char.encode("utf-8"))
        return string, bytes(raw), len(string) == 1 and decoder.get(string[0]) == 32


def stream_detokenizer(tokenizer: Any, table: dict[int, TokenText]) -> Any:
    """A new streaming detokenizer for one request: ``CachedBPEDetokenizer`` where the
    tokenizer's is mlx-lm's byte-level BPE one (exactly that class), else the tokenizer's own."""
    detokenizer = tokenizer.detokenizer
    if type(detokenizer) is BPEStreamingDetokenizer:
        return CachedBPEDetokenizer(detokenizer, table)
    return detokenizer


class TextStream:
    def __init__(self, detokenizer: Any, stop_strings: list[str] | None) -> None:
        self._detokenizer = detokenizer
        self._machine: Any = None
        self._state: Any = None
        if stop_strings:
            # A transition to state None ends the text at the match.
            self._machine = TextStateMachine({"normal": [(s, None) for s in stop_strings]})
            self._state = self._machine.make_state("normal")
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once one did

    def add_token(self, token: int) -> str:
        """Feed one generated token; return the text now safe to emit (maybe empty).

        Sets ``stopped`` (and ``stop_string``) when a stop string completed; the returned text
        then ends before it.
        """
        detokenizer = self._detokenizer
        detokenizer.add_token(token)
        segment: str = detokenizer.last_segment
        if self._machine is None or not segment:
            return segment
        return self._filter(segment)

    def finish(self) -> str:
        """Flush held-back text at the end of generation (EOS, length, abort)."""
        if self.stopped:
            return ""
        self._detokenizer.finalize()
        text = self._filter(self._detokenizer.last_segment)
        if self._machine is not None and not self.stopped:
            self._state, held_back, _ = TextStateMachine.flush(self._state)
            text += held_back
        return text

    def _filter(self, segment: str) -> str:
        if self._machine is None or not segment:
            return segment
        held = self._state[3]  # text held back as a possible start of a stop string
        self._state, pieces = TextStateMachine.split(self._state, segment)
        text = "".join(text for _, text in pieces)
        if self._state[0] is None:
            self.stopped = True
            # What was read, less the text let out before the match and what follows it.
            read, rest = held + segment, self._state[3]
            self.stop_string = read[len(text) : len(read) - len(rest)]
        return text
