"""A decode batch whose rows join and leave in place.

mlx-lm's decode batch keeps one KV cache for all its rows. A row that finishes is filtered out
(every other row's cache copied: ``keys[kept]``), and a group that begins decoding is
concatenated on (both caches padded, then copied). Measured on tiny (CPU, float32, 8 layers):
with 8 rows at 400 tokens of context, one filter took ~8 ms and one extend 28-60 ms, against a
decode step of ~22 ms. Writing 2 joining rows into free rows of a 12-row cache in place took
1.5 ms (3.1 ms at 1,000 tokens). Short requests beside long streams join and leave every few
steps, so the steady streams paid those copies again and again (the victim's inter-token p99
under churn in ``bench isolation``).

Here a row that leaves leaves a vacancy: its cache row stays, and the model the step calls
feeds it token 0 and drops its logits (so mlx-lm's step and ours run unchanged). A joining
group whose contexts fit the batch's window (no longer than the batch's longest) is written
into vacancies, each row right-aligned with the batch and the cells before it masked as left
padding. A vacancy still costs a row's decode work each step, so vacancies are compacted
(mlx-lm's filter, one copy) once the work they took (their share of each step's time) adds up
to what the copy takes (measured at each compaction, per cell copied): rent, then buy. Where
rows are costly and copies cheap (a wide batch on a CPU) that is a step or two; where copies
are costly (long contexts, a GPU's cheap rows) vacancies wait longer for joiners. A group
that cannot join in place (no room, a context longer than the window, or caches other than
``BatchKVCache``: rotating windows, state-space layers) compacts the batch and joins by
mlx-lm's extend, as before.

Rows keep mlx-lm's order everywhere outside the forward pass: ``uids``, ``tokens`` and every
per-row list hold live rows only; ``cache_rows`` maps each to its row of the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

# Weight of the latest compaction in the measured copy speed.
COPY_SMOOTHING = 0.3


@dataclass(slots=True)
class RowSlotCounters:
    """Since the generator was made: groups written into vacancies, groups joined by mlx-lm's
    extend (a copy of the batch), and compactions (a copy of the live rows)."""

    joined_in_place: int = 0
    joined_by_copy: int = 0
    compactions: int = 0
    # Seconds a compaction took per cell it copied (a live row's window), measured on this
    # machine: what keeping vacancies is weighed against. None before the first one.
    copy_seconds_per_cell: float | None = None

    def observe_copy(self, seconds: float, cells: int) -> None:
        if cells <= 0:
            return
        measured = seconds / cells
        last = self.copy_seconds_per_cell
        self.copy_seconds_per_cell = (
            measured if last is None else last + COPY_SMOOTHING * (measured - last)
        )


class SlottedGenerationBatch(GenerationBatch):  # type: ignore[misc]  # mlx-lm is untyped
    # mlx-lm's: the token each row feeds next and its logprobs; the rows' KV caches per layer.
    _next_tokens: mx.array
    prompt_cache: list[Any]
    _model: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Each live row's row of the cache; None while they are the same (no vacancy).
        self.cache_rows: list[int] | None = None
        self._cache_row_index: mx.array | None = None
        # Rows of the cache (live and vacant) while there are vacancies.
        self._capacity = 0
        # Seconds of decode work the vacancies have taken (their share of each step's time).
        self._rent = 0.0
        self._last_step_seconds = 0.0
        # Shared by a generator's decode batches (it hands its own in).
        self.slot_counters = RowSlotCounters()
        super().__init__(*args, **kwargs)

    @property
    def rows_in_cache(self) -> int:
        """Rows a forward pass computes: live rows and vacancies."""
        return self._capacity if self.cache_rows is not None else len(self.uids)

    @property
    def model(self) -> Any:
        """The model a step calls: while there are vacancies, one that feeds them token 0 and
        drops their logits, so that every step (mlx-lm's own included) sees live rows only."""
        if self._cache_row_index is None:
            return self._model
        return self._feed_vacancies

    @model.setter
    def model(self, model: Any) -> None:
        self._model = model

    def _feed_vacancies(self, inputs: mx.array, cache: Any = None) -> mx.array:
        index = self._cache_row_index
        assert index is not None
        fed = mx.zeros((self._capacity, *inputs.shape[1:]), dtype=inputs.dtype)
        fed[index] = inputs
        return self._model(fed, cache=cache)[index]  # type: ignore[no-any-return]

    def next(self) -> list[Any]:
        if self.cache_rows is not None and self._rent >= self._compaction_seconds():
            self.compact()
        started = time.perf_counter()
        responses: list[Any] = super().next()
        self._last_step_seconds = time.perf_counter() - started
        if self.cache_rows is not None:
            vacant = self._capacity - len(self.uids)
            self._rent += self._last_step_seconds * vacant / self._capacity
        return responses

    def filter(self, keep: list[int]) -> None:
        if not keep or not self._slottable(self.prompt_cache):
            if keep:  # no row kept: mlx-lm drops the whole cache, nothing to copy
                self.compact()
            super().filter(keep)
            self._set_rows(None)
            return
        rows = self._rows()
        capacity = self.rows_in_cache
        # mlx-lm's filter of every per-row list, the cache set aside: it keeps its rows.
        caches, self.prompt_cache = self.prompt_cache, []
        try:
            super().filter(keep)
        finally:
            self.prompt_cache = caches
        self._set_rows([rows[i] for i in keep], capacity)

    def extend(self, batch: Any) -> None:
        if isinstance(batch, SlottedGenerationBatch):
            batch.compact()
        rows = self._vacancies_for(batch)
        if rows is None:
            self.compact()
            if self.uids and len(batch):
                self.slot_counters.joined_by_copy += 1
            super().extend(batch)
            return
        for mine, theirs in zip(self.prompt_cache, batch.prompt_cache, strict=True):
            _write_rows(mine, theirs, rows)
        live = self._rows()
        caches, self.prompt_cache = self.prompt_cache, []
        try:
            super().extend(batch)  # every per-row list; the cache was written above
        finally:
            self.prompt_cache = caches
        self.slot_counters.joined_in_place += 1
        self._set_rows(live + rows, self._capacity)

    def compact(self) -> None:
        """Drop the vacancies from the cache (one copy of the live rows)."""
        if self.cache_rows is None:
            return
        caches = self.prompt_cache
        mx.eval(self._next_tokens)  # the last step's work first: the copy is timed alone
        started = time.perf_counter()
        for cache in caches:
            cache.filter(self.cache_rows)
        mx.eval([cache.state[:2] for cache in caches])
        counters = self.slot_counters
        counters.compactions += 1
        counters.observe_copy(time.perf_counter() - started, len(self.uids) * caches[0]._idx)
        self._set_rows(None)

    def extract_cache(self, idx: int) -> list[Any]:
        row = idx if self.cache_rows is None else self.cache_rows[idx]
        return [cache.extract(row) for cache in self.prompt_cache]

    # -- internals ---------------------------------------------------------------------------

    def _rows(self) -> list[int]:
        return list(range(len(self.uids))) if self.cache_rows is None else list(self.cache_rows)

    def _set_rows(self, rows: list[int] | None, capacity: int = 0) -> None:
        """The live rows' rows of the cache, of ``capacity`` rows (None: the same rows)."""
        if rows == list(range(capacity)):
            rows = None
        self.cache_rows = rows
        self._cache_row_index = None if rows is None else mx.array(rows)
        self._capacity = capacity if rows is not None else 0
        if rows is None or len(rows) == capacity:
            self._rent = 0.0  # no vacancy left: nothing to compact for (a join filled them)

    def _compaction_seconds(self) -> float:
        """What compacting the cache would take now: the measured copy speed times the live
        rows' cells, or (before any was measured) a decode step."""
        per_cell = self.slot_counters.copy_seconds_per_cell
        if per_cell is None:
            return self._last_step_seconds
        window: int = self.prompt_cache[0]._idx
        return per_cell * len(self.uids) * window

    def _vacancies_for(self, batch: Any) -> list[int] | None:
        """The vacancies ``batch``'s rows can be written into, or None."""
        if self.cache_rows is None or not len(batch):
            return None
        mine, theirs = self.prompt_cache, batch.prompt_cache
        if len(mine) != len(theirs) or not (self._slottable(mine) and self._slottable(theirs)):
            return None
        if any(b._idx > a._idx for a, b in zip(mine, theirs, strict=True)):
            return None  # longer than the window: the whole batch would have to move
        taken = set(self.cache_rows)
        free = [row for row in range(self._capacity) if row not in taken]
        return free[: len(batch)] if len(free) >= len(batch) else None

    @staticmethod
    def _slottable(caches: list[Any]) -> bool:
        return bool(caches) and all(
            type(cache) is BatchKVCache and cache.keys is not None for cache in caches
        )


def _write_rows(cache: BatchKVCache, group: BatchKVCache, rows: list[int]) -> None:
    """Write ``group``'s rows into ``cache``'s ``rows``, right-aligned with the cache's window;
    the cells before them become left padding (stale cells, masked)."""
    end = cache._idx
    start = end - group._idx
    index = mx.array(rows)
    cache.keys[index, :, start:end, :] = group.keys[..., : group._idx, :]
    cache.values[index, :, start:end, :] = group.values[..., : group._idx, :]
    cache.left_padding[index] = group.left_padding + start
    cache.offset[index] = group.offset
