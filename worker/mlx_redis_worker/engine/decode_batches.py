"""The running sequences' decode batches, grouped by context length.

mlx-lm's decode batch keeps one KV cache for all its rows, each padded to the longest context:
a decode step reads rows × longest-context cells. Measured on tiny (CPU, float32): 8 streams
at 100 tokens of context step in 30 ms; one more at 2,300 tokens makes the step 111 ms, at
8,000 tokens 274 ms, whereas that long row alone steps in 32 and 50 ms. One tenant's long
prompt, once it decodes, slowed every other stream 3.7-9x.

Here rows decode in one batch while padding them to the longest context costs at most a
quarter of a step more than their own contexts (``PADDING_SHARE``); rows further apart decode
in batches of their own, a forward pass each. A decode step is memory-bound, so a pass costs
about the bytes it reads: the weights (``weight_tokens``: the weights' bytes in tokens of KV
cache) plus the batch's padded cells.

The batch with the shortest contexts is the steady one: it decodes every step. Every other
batch costs more than a steady step, and without a bound its pass would sit in every step of
the steady streams (two long-context batches: three passes a step). So each other batch earns
``share`` steady steps of credit per step and runs when its pass is paid for: a long-context
stream's tokens come as often as its cost allows beside the steady ones, and the steady
streams' step grows by about ``share`` of a step (the same bound, ``max_prefill_stall``, that
limits prefill beside them; the scheduler gives prefill what a side pass left of it). With
an infinite share every batch decodes every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import GenerationBatch

# The least credit a side batch earns a step, whatever the share (a stall bound of 0): every
# stream keeps progressing (the same floor as prompts in prefill).
from mlx_redis_worker.engine.prefill_pace import MIN_SHARE
from mlx_redis_worker.engine.row_slots import SlottedGenerationBatch

# Rows share a batch while padding them to the longest context costs at most this share of
# their step (weights plus their own contexts).
PADDING_SHARE = 0.25


@dataclass(eq=False, slots=True)
class DecodeBatch:
    batch: SlottedGenerationBatch
    # Steady steps of credit earned toward this batch's next pass (side batches only).
    credit: float = 0.0
    # The plan that last ran this batch: of the side batches due, the longest unrun goes.
    last_pass: int = 0

    def contexts(self, max_kv_size: int | None) -> list[int]:
        lengths = [len(tokens) for tokens in self.batch.tokens]
        return lengths if max_kv_size is None else [min(n, max_kv_size) for n in lengths]


@dataclass(slots=True)
class DecodePlan:
    """The batches one decode step runs, the steady one first."""

    batches: list[DecodeBatch] = field(default_factory=list)
    # The side passes' cost in steady steps (what they took of the stall bound).
    side_steps: float = 0.0
    # The steady pass's share of the step's decode time.
    steady_fraction: float = 1.0


class DecodeBatches:
    """Engine thread only: the decode batches of one generator."""

    def __init__(
        self,
        make_empty: Callable[[], SlottedGenerationBatch],
        *,
        weight_bytes: int | None,
        share: float,
        max_kv_size: int | None = None,
    ) -> None:
        self._make_empty = make_empty
        self._weight_bytes = weight_bytes
        # The weights in tokens of KV cache, from the first batch's cache (inf: no KV cache,
        # or weights not known: one batch, as mlx-lm decodes).
        self.weight_tokens = math.inf
        self._measured = False
        self.share = max(share, MIN_SHARE)
        self.max_kv_size = max_kv_size
        self._batches: list[DecodeBatch] = []
        self._plans = 0

    def __len__(self) -> int:
        return sum(len(part.batch) for part in self._batches)

    def __iter__(self) -> Iterator[SlottedGenerationBatch]:
        return (part.batch for part in self._batches)

    @property
    def count(self) -> int:
        """Batches (forward passes) the running sequences decode in."""
        return len(self._batches)

    def add(self, group: GenerationBatch) -> None:
        """Take a group of sequences that begin decoding: into the batch whose padding it
        costs least, within ``PADDING_SHARE``, or into a batch of its own."""
        if len(group) == 0:
            return
        if not self._measured:
            self._measured = True
            token_bytes = _kv_bytes_per_token(group.prompt_cache)
            if token_bytes > 0 and self._weight_bytes is not None:
                self.weight_tokens = self._weight_bytes / token_bytes
        joined = DecodeBatch(group)
        best: DecodeBatch | None = None
        for part in self._batches:
            if self._fits(part, joined) and (
                best is None or self._waste(part, joined) < self._waste(best, joined)
            ):
                best = part
        if best is None:
            part = DecodeBatch(self._make_empty())
            part.batch.extend(group)
            self._batches.append(part)
        else:
            best.batch.extend(group)
        self.tidy()

    def tidy(self) -> None:
        """Drop emptied batches and merge batches whose contexts have come together (after a
        removal, or as their rows grow); the steady batch first."""
        self._batches = [part for part in self._batches if len(part.batch) > 0]
        self._batches.sort(key=self._longest)
        merged = True
        while merged and len(self._batches) > 1:
            merged = False
            for low, high in zip(self._batches, self._batches[1:], strict=False):
                if self._fits(low, high):
                    low.batch.extend(high.batch)
                    low.credit = max(low.credit, high.credit)
                    self._batches.remove(high)
                    merged = True
                    break
        if self._batches:
            self._batches[0].credit = 0.0

    def plan(self, with_sides: bool = True) -> DecodePlan:
        """This step's passes: the steady batch, and (``with_sides``) the side batch that has
        earned its pass (one a step, the one that ran longest ago: two side passes in one step
        would stretch it twice). Without ``with_sides`` side batches only earn their credit; an
        infinite share runs every batch every step."""
        plan = DecodePlan()
        if not self._batches:
            return plan
        steady, *sides = self._batches
        plan.batches.append(steady)
        steady_cost = self._cost(steady)
        self._plans += 1
        due: DecodeBatch | None = None
        for part in sides:
            steps = self._cost(part) / steady_cost
            if math.isinf(self.share):
                plan.batches.append(part)
                plan.side_steps += steps
                continue
            # A pass's worth of credit and this step's is kept (a batch that waited for
            # another's pass catches up by one pass at most; the remainder of a pass counts).
            part.credit = min(part.credit + self.share, steps + self.share)
            if (
                with_sides
                and part.credit >= steps
                and (due is None or part.last_pass < due.last_pass)
            ):
                due = part
        if due is not None:
            steps = self._cost(due) / steady_cost
            due.credit -= steps
            due.last_pass = self._plans
            plan.batches.append(due)
            plan.side_steps += steps
        plan.steady_fraction = 1.0 / (1.0 + plan.side_steps)
        return plan

    def remove(self, uids: set[int]) -> None:
        """Remove these sequences' rows."""
        for part in self._batches:
            batch = part.batch
            gone = {row for row, uid in enumerate(batch.uids) if uid in uids}
            if gone:
                batch.filter([row for row in range(len(batch)) if row not in gone])
        self.tidy()

    def extract(self, uids: set[int]) -> dict[int, Any]:
        """These sequences' caches and tokens, left in place."""
        return {
            uid: (part.batch.extract_cache(row), part.batch.tokens[row])
            for part in self._batches
            for row, uid in enumerate(part.batch.uids)
            if uid in uids
        }

    def nbytes(self) -> int:
        return sum(c.nbytes for part in self._batches for c in part.batch.prompt_cache)

    # -- the cost model ------------------------------------------------------------------------

    def _longest(self, part: DecodeBatch) -> int:
        return max(part.contexts(self.max_kv_size), default=0)

    def _cost(self, part: DecodeBatch) -> float:
        """A pass's bytes in tokens of KV cache: the weights, and every row (vacancies too)
        padded to the longest context."""
        return self.weight_tokens + part.batch.rows_in_cache * self._longest(part)

    def _waste(self, a: DecodeBatch, b: DecodeBatch) -> float:
        contexts = a.contexts(self.max_kv_size) + b.contexts(self.max_kv_size)
        return len(contexts) * max(contexts) - sum(contexts)

    def _fits(self, a: DecodeBatch, b: DecodeBatch) -> bool:
        contexts = a.contexts(self.max_kv_size) + b.contexts(self.max_kv_size)
        return self._waste(a, b) <= PADDING_SHARE * (self.weight_tokens + sum(contexts))


def _kv_bytes_per_token(cache: list[Any]) -> int:
    """The bytes one token takes in these layers' KV caches (layers without keys, such as a
    state-space model's, take none per token)."""
    total = 0
    for layer in cache:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.ndim != 4:
            continue
        total += keys.shape[1] * keys.shape[3] * keys.itemsize
        total += values.shape[1] * values.shape[3] * values.itemsize
    return total
