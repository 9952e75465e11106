"""Putting one request's events in order: each seq exactly once, no gaps.

Events reach a subscriber twice over (the live channel and the replay log) and the channel can
repeat or reorder them; seq numbers make the merge exact. No I/O here, so it is easy to test.
"""

from __future__ import annotations

from protocol.messages import Event


class EventOrdering:
    """Releases events in seq order, each seq once, holding back those that arrive early.

    The queued marker (seq 0) is optional: it is released only if nothing came before it,
    because a producer that doesn't write it leaves a log that starts at seq 1.
    """

    def __init__(self) -> None:
        self.last_seq = 0
        self.started = False
        self.finished = False
        self._early: dict[int, Event] = {}

    def offer(self, event: Event) -> list[Event]:
        """The events that are now next in order (possibly none), this one included if so."""
        if self.finished:
            return []
        if event.seq == 0:
            if self.started:
                return []
            self.started = True
            return [event]
        if event.seq <= self.last_seq:
            return []
        self._early.setdefault(event.seq, event)
        return self._release()

    @property
    def waiting_for_gap(self) -> bool:
        """True when later events are held back because an earlier seq has not arrived."""
        return bool(self._early)

    def _release(self) -> list[Event]:
        released: list[Event] = []
        while not self.finished and (event := self._early.pop(self.last_seq + 1, None)):
            released.append(event)
            self.last_seq = event.seq
            self.started = True
            self.finished = event.terminal
        if self.finished:
            self._early.clear()
        return released
