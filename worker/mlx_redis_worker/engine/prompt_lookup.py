"""Prompt-lookup drafting: guess a sequence's next tokens from its own context, no second model.

When the last few tokens (an n-gram) occurred earlier in the prompt or the output so far, the
tokens that followed that earlier occurrence are the draft. Input-grounded work (edit this
code, quote this text, fill this JSON) repeats long runs of its input, so drafts are often
right, and a wrong one costs only a position in the verify pass.

The index maps each n-gram to where the tokens after its latest occurrence start. It only
holds occurrences that have a following token, so the current suffix never matches itself;
it is extended as tokens arrive (a few dict writes per token), never rebuilt.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 3
MIN_NGRAM = 1


class PromptLookup:
    """The n-gram index of one sequence's tokens (prompt + output), engine thread only."""

    __slots__ = ("_index", "_tokens", "max_ngram", "min_ngram")

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("PromptLookup needs 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._tokens: list[int] = []
        self._index: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def sync(self, tokens: Sequence[int]) -> None:
        """Index the tokens of ``tokens`` past the ones already indexed (``tokens`` only grows
        by appending: a sequence's context)."""
        for token in tokens[len(self._tokens) :]:
            self.append(token)

    def append(self, token: int) -> None:
        tokens = self._tokens
        position = len(tokens)
        # Every n-gram that ends at the previous token now has a continuation: this position.
        for n in range(self.min_ngram, min(self.max_ngram, position) + 1):
            self._index[tuple(tokens[position - n : position])] = position
        tokens.append(token)

    def draft(self, last: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest earlier n-gram equal to the context
        plus ``last`` (the token about to be fed); [] when nothing matches.

        An occurrence close to the present runs into it: the copy goes on through ``last``
        and then through its own guesses, so a repeating pattern (a loop, a table's rows) is
        drafted a whole ``limit`` ahead."""
        if limit <= 0:
            return []
        tokens = self._tokens
        for n in range(min(self.max_ngram, len(tokens) + 1), self.min_ngram - 1, -1):
            key = (*tokens[len(tokens) - n + 1 :], last) if n > 1 else (last,)
            start = self._index.get(key)
            if start is not None:
                guess = tokens[start : start + limit]
                end = len(tokens)
                while len(guess) < limit:
                    at = start + len(guess)
                    guess.append(last if at == end else guess[at - end - 1])
                return guess
        return []
