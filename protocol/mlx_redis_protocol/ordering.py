"""Putting one request's events in order: each seq exactly once, no gaps.

Events reach a subscriber twice over (the live channel and the replay log) and the channel can
repeat or reorder them; seq numbers make the merge exact. No I/O here, so it is easy to test.

A repeat is dropped only when it is the same event: a seq already released coming back with
other bytes, or a newer attempt that does not open with its reset, means the history was
rewritten (Redis lost events it had delivered, in a failover) and raises StreamRewritten.
"""

from __future__ import annotations

from mlx_redis_protocol.errors import StreamRewritten
from mlx_redis_protocol.messages import Event, ResetEvent


class EventOrdering:
    """Releases events in seq order, each seq once, holding back those that arrive early.

    The queued marker (seq 0) is optional: it is released only if nothing came before it,
    because a producer that doesn't write it leaves a log that starts at seq 1. ``offer`` takes
    a fingerprint of the event's bytes where the caller has them (the same event is the same
    bytes on the channel and in the log), to tell a repeat from a rewrite.
    """

    def __init__(self) -> None:
        self.last_seq = 0
        self.started = False
        self.finished = False
        self.attempt = 0  # the attempt of the newest released event
        self._early: dict[int, tuple[Event, int | None]] = {}
        self._fingerprints: dict[int, int | None] = {}  # of released events, by seq

    def offer(self, event: Event, fingerprint: int | None = None) -> list[Event]:
        """The events that are now next in order (possibly none), this one included if so."""
        if self.finished:
            return []
        if event.seq == 0:
            if self.started:
                return []
            self.started = True
            return [event]
        if event.seq <= self.last_seq:
            released = self._fingerprints.get(event.seq)
            if None not in (fingerprint, released) and fingerprint != released:
                raise StreamRewritten(event.request_id, f"seq {event.seq} changed")
            return []
        self._early.setdefault(event.seq, (event, fingerprint))
        return self._release()

    @property
    def waiting_for_gap(self) -> bool:
        """True when later events are held back because an earlier seq has not arrived."""
        return bool(self._early)

    def _release(self) -> list[Event]:
        released: list[Event] = []
        while not self.finished and (early := self._early.pop(self.last_seq + 1, None)):
            event, fingerprint = early
            self._check_attempt(event)
            released.append(event)
            self.last_seq = event.seq
            self.started = True
            self.finished = event.terminal
            self.attempt = event.attempt
            self._fingerprints[event.seq] = fingerprint
        if self.finished:
            self._early.clear()
            self._fingerprints.clear()
        return released

    def _check_attempt(self, event: Event) -> None:
        """Attempts only grow, and each one after the first opens with a reset."""
        if self.attempt < 1 or event.attempt == self.attempt:
            return
        if event.attempt < self.attempt or not isinstance(event, ResetEvent):
            raise StreamRewritten(
                event.request_id,
                f"attempt {event.attempt} at seq {event.seq} follows attempt {self.attempt} "
                "without its reset",
            )
