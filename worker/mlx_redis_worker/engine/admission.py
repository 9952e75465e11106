"""Which waiting requests are prefilled next: shortest prompt first, with an age bound.

When many requests arrive together, the average time to first token is set by the order of
their prefills: the shortest prompts first finish the most prefills soonest. Alone that would
starve a long prompt behind a stream of short ones, so a request that has waited
``max_wait`` seconds or more is overdue, and overdue requests go first, oldest first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def pick_prefill_group(
    waiting: Iterable[T],
    size: int,
    now: float,
    max_wait: float,
    length: Callable[[T], int],
    arrival: Callable[[T], float],
) -> list[T]:
    """Up to ``size`` of ``waiting`` (in arrival order): the overdue ones, oldest first, then
    the shortest of the rest (ties: the earlier arrival)."""
    if size <= 0:
        return []
    overdue: list[T] = []
    rest: list[tuple[int, int, T]] = []
    for index, item in enumerate(waiting):
        if now - arrival(item) >= max_wait:
            overdue.append(item)
        else:
            rest.append((length(item), index, item))
    if len(overdue) >= size:
        return sorted(overdue, key=arrival)[:size]
    shortest = heapq.nsmallest(size - len(overdue), rest, key=lambda entry: entry[:2])
    return sorted(overdue, key=arrival) + [item for _, _, item in shortest]
