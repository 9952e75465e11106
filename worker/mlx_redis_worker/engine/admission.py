"""Which waiting requests are prefilled next: shortest prompt first, with an age bound.

When many requests arrive together, the average time to first token is set by the order of
their prefills: the shortest prompts first finish the most prefills soonest. Alone that would
starve a long prompt behind a stream of short ones, so a request that has waited
``max_wait`` seconds or more is overdue, and overdue requests go first, oldest first.
"""

from __future__ import annotations

import heapq
import itertools
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
    long_room: int | None = None,
    long_tokens: int = 0,
    short_room: int | None = None,
) -> list[T]:
    """Up to ``size`` of ``waiting`` (in arrival order): the overdue ones, oldest first, then
    the shortest of the rest (ties: the earlier arrival). With ``long_room``, at most that
    many of them longer than ``long_tokens`` (a long one past that stays waiting, overdue or
    not, while shorter ones are taken); with ``short_room``, at most that many of the others
    (the two prefill lanes' free rows)."""
    if size <= 0:
        return []
    overdue: list[T] = []
    rest: list[tuple[int, int, T]] = []
    for index, item in enumerate(waiting):
        if now - arrival(item) >= max_wait:
            overdue.append(item)
        else:
            rest.append((length(item), index, item))
    group: list[T] = []
    long_room = size if long_room is None else long_room
    short_room = size if short_room is None else short_room
    # The rest by (length, arrival index), popped only as far as the group needs: a queue of
    # a thousand costs a heapify a step, not a sort.
    heapq.heapify(rest)  # the index breaks every tie: items are never compared
    shortest = (heapq.heappop(rest)[2] for _ in range(len(rest)))
    for item in itertools.chain(sorted(overdue, key=arrival), shortest):
        if length(item) > long_tokens:
            if long_room <= 0:
                continue
            long_room -= 1
        else:
            if short_room <= 0:
                continue
            short_room -= 1
        group.append(item)
        if len(group) == size:
            break
    return group
