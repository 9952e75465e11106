"""Constrained sequences inside the batch: each one's grammar, and all their masks in one call.

Each constrained sequence has its own ``GrammarProcessor`` (one of mlx-lm's per-sequence
logits processors): before each token it advances its matcher (a copy of the compiled one) by
the token just sampled, takes the bitmask of the tokens allowed next and sets every other
logit to -inf. Unconstrained sequences have no processor and are untouched.

A decode step's masks are computed together (``GrammarBatch``): the first constrained row the
step reaches starts the step's forward pass (``mx.async_eval``), advances every constrained
row by its last token and computes all their masks in one llguidance call, which releases the
GIL and spreads the rows over its threads while the forward pass runs. A costly grammar costs
the step its own mask beside the model's time, not the sum of every row's after it. A row's
first mask (in the step that starts it) is its own.

Each mask is bounded by the work limits its matcher was built with (``GrammarLimits``): a row
over one ends with ``GrammarLimitError`` naming it, whatever the machine's load. Wall-clock
time is only a far outer net: a row whose own masks take over ``max_mask_us`` more than
``SLOW_MASKS_ALLOWED`` times is refused; a batch call over it sends its rows back to masks of
their own (each timed) for a few steps, so a slow row is found without charging the others.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import mlx.core as mx
import numpy as np

from mlx_redis_worker.engine.config import GrammarLimits
from mlx_redis_worker.engine.sampling import Sampler
from mlx_redis_worker.engine.structured import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarLimitError,
    GrammarStats,
    limit_named,
    over_limit_message,
)

# Masks over max_mask_us a sequence may take before it is refused: one slow mask is noise,
# a run of them is the grammar.
SLOW_MASKS_ALLOWED: Final = 3
# Limits whose error lives in the lexer every copy of a compiled grammar shares.
_SHARED_LIMITS: Final = frozenset({"max_mask_lexer_fuel", "max_lexer_states"})


class GrammarBatch:
    """The constrained rows of one engine's batch (engine thread only) and their masks."""

    def __init__(self, stats: GrammarStats, vocab_size: int) -> None:
        self.stats = stats
        self.words = (vocab_size + 31) // 32
        self.rows: set[GrammarProcessor] = set()
        self._executor: Any = None
        self._masks = np.zeros((0, self.words), dtype=np.int32)
        self._decoding = False

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """A decode step of the running batch: the only calls that compute masks together
        (every constrained row is in it; the rows a step starts, or a row that finished
        in it, are not due anything more)."""
        self._decoding = True
        try:
            yield
        finally:
            self._decoding = False

    def prepare(self, logits: mx.array, max_mask_us: int) -> None:
        """Advance every constrained row due a mask and compute their masks in one call,
        while the step's forward pass (``logits``) runs."""
        due = [row for row in self.rows if row.due] if self._decoding else []
        if len(due) < 2:
            return  # one row computes its own: no call to share
        mx.async_eval(logits)  # type: ignore[no-untyped-call]
        advanced = [row for row in due if row.advance()]
        if not advanced:
            return  # each says why at its own call
        if len(self._masks) < len(advanced):
            self._masks = np.zeros((len(advanced), self.words), dtype=np.int32)
        started = time.perf_counter()
        self.executor.unsafe_compute_mask_ptr(
            [(row.matcher, index) for index, row in enumerate(advanced)],
            self._masks.ctypes.data,
            self.words * 4,
            len(self._masks),
        )
        seconds = time.perf_counter() - started
        self.stats.batched_calls += 1
        self.stats.batched_masks += len(advanced)
        # Over the net, the rows are timed alone for a few steps: the slow one is found there.
        alone = SLOW_MASKS_ALLOWED + 1 if seconds * 1e6 > max_mask_us else 0
        for index, row in enumerate(advanced):
            row.take(self._masks[index], alone_steps=alone)

    @property
    def executor(self) -> Any:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor


class GrammarProcessor:
    """One constrained sequence's logits processor and its matcher (engine thread only)."""

    def __init__(
        self,
        compiler: GrammarCompiler,
        batch: GrammarBatch,
        compiled: CompiledGrammar,
        subject: str = "response_format",
    ) -> None:
        self.matcher = compiled.matcher.deep_copy()
        compiler.stats.matcher_copies += 1  # engine thread only
        self.subject = subject  # what the request sent: response_format or tools
        self._compiler = compiler
        self._key = compiled.key
        self._limits: GrammarLimits = compiler.limits
        self._batch = batch
        batch.rows.add(self)
        self._bitmask = np.zeros(batch.words, dtype=np.int32)
        self._table = compiler.bit_table()
        self._stats = compiler.stats
        self._started = False
        self._advanced = False  # by the token sampled last (for the coming mask)
        self._ready = False  # the coming mask is in ``_bitmask``
        self._alone_steps = 0  # steps left to compute its own (timed) mask
        self._slow_masks = 0
        self._consumed = 0  # sampled tokens the matcher has advanced by
        # What this sequence's sampler returned last, until the matcher takes it.
        self._sampled: mx.array | None = None

    def sampler(self, base: Sampler | None) -> Sampler:
        """This sequence's sampler (``base``, or greedy for None) keeping what it samples: the
        next mask needs that token, and the array the sampler returned is computed with the
        step, whereas the token context mlx-lm hands processors is a new array, one more
        kernel and device round trip per sequence and step to read."""

        def sample(logprobs: mx.array) -> mx.array:
            self._sampled = None  # should ``base`` fail, the next call reads the context
            sampled = base(logprobs) if base is not None else mx.argmax(logprobs, axis=-1)
            self._sampled = sampled
            return sampled

        return sample

    @property
    def due(self) -> bool:
        """Whether a batch call may compute this row's coming mask: it is decoding (its first
        mask was its own), it has a sampled token the matcher has not taken (none between its
        call and its sampler's, so a row is never served twice a step), and it is not being
        timed alone."""
        return (
            self._started
            and not self._ready
            and self._sampled is not None
            and self._alone_steps == 0
            and not self.matcher.is_error()
        )

    def advance(self) -> bool:
        """Take the token sampled last (from this sequence's own sampler); False when the
        matcher refused it (its own call then says why)."""
        assert self._sampled is not None
        sampled, self._sampled = self._sampled, None
        self._consume(int(sampled.item()))  # type: ignore[arg-type]
        self._advanced = True
        return not self.matcher.is_error()

    def take(self, mask: np.ndarray[Any, Any], alone_steps: int) -> None:
        np.copyto(self._bitmask, mask)
        self._ready = True
        self._alone_steps = alone_steps

    def close(self) -> None:
        """The sequence left the batch."""
        self._batch.rows.discard(self)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started and not self._ready:
            self._batch.prepare(logits, self._limits.max_mask_us)
        # The first call's last token is the prompt's; after that, the token just sampled.
        if self._started and not self._advanced:
            last, self._sampled = self._sampled, None
            if last is None:
                self._stats.context_reads += 1
                last = tokens[-1]
            self._consume(int(last.item()))  # type: ignore[arg-type]
        if not self._ready and not self.matcher.is_error():
            self._compute_alone()
        self._started, self._advanced, self._ready = True, False, False
        if self.matcher.is_error():
            raise self._failure()
        # Each byte of the little-endian bitmask picks its 8 tokens' row of 0 / -inf.
        bias = self._table[mx.array(self._bitmask.view(np.uint8))].reshape(-1)
        return logits + bias[: logits.shape[-1]].astype(logits.dtype)

    def _compute_alone(self) -> None:
        started = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        seconds = time.perf_counter() - started
        self._alone_steps = max(0, self._alone_steps - 1)
        if seconds * 1e6 > self._limits.max_mask_us:
            self._on_slow_mask(seconds)

    def _failure(self) -> Exception:
        """Why the matcher stopped: a limit its format went over (the request's fault), or a
        failure of the matcher itself."""
        error = self.matcher.get_error()
        limit = limit_named(error)
        if limit is None:
            return RuntimeError(f"grammar matcher failed: {error}")
        self._stats.count_over(limit)
        if limit in _SHARED_LIMITS:
            self._compiler.forget(self._key)
        return GrammarLimitError(over_limit_message(self.subject, error, self._limits))

    def _on_slow_mask(self, seconds: float) -> None:
        """Count a mask over the safety net; refuse the sequence past the allowed count."""
        self._slow_masks += 1
        self._stats.slow_masks += 1
        if self._slow_masks <= SLOW_MASKS_ALLOWED:
            return
        self._stats.count_over("max_mask_us")
        raise GrammarLimitError(
            f"{self.subject}'s token masks took over max_mask_us ({self._limits.max_mask_us}) "
            f"{self._slow_masks} times (the last {seconds * 1e6:.0f} us)"
        )

    def matches(self, output_tokens: Sequence[int]) -> bool:
        """Whether ``output_tokens`` (the whole output, EOS left out) is a complete match. The
        matcher advances by a sampled token only when asked for the next mask, so the last
        token of an output that max_tokens cut is taken here."""
        for token in output_tokens[self._consumed :]:
            self._consume(token)
        return bool(self.matcher.is_accepting()) and not self.matcher.is_error()

    def _consume(self, token: int) -> None:
        self.matcher.consume_token(token)
        self._consumed += 1
