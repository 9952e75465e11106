"""Incremental text for one request: streaming detokenization plus stop strings.

Text comes from the tokenizer's own streaming detokenizer (mlx-lm). Stop strings are matched on
text with mlx-lm's ``TextStateMachine``: text that might be the start of a stop string is held
back until it is known not to be, so a stop string never leaks into the output, even when it is
split across tokens.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import TextStateMachine


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
