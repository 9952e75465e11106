"""The seq ordering on its own: any arrival order, any repeats, one clean sequence out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_redis_protocol.errors import StreamRewritten
from mlx_redis_protocol.messages import Event, QueuedEvent
from mlx_redis_protocol.ordering import EventOrdering
from tests.protocol.helpers import delta, done, reset


def events_up_to(last: int) -> list[Event]:
    return [*(delta("r", seq, f"t{seq}") for seq in range(1, last)), done("r", last, "")]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), last=st.integers(1, 30))
def test_any_arrival_order_with_repeats(data: st.DataObject, last: int) -> None:
    events = events_up_to(last)
    arrivals = data.draw(st.permutations(events + data.draw(st.lists(st.sampled_from(events)))))
    ordering = EventOrdering()
    released = [out for event in arrivals for out in ordering.offer(event)]
    assert [event.seq for event in released] == list(range(1, last + 1))
    assert ordering.finished and not ordering.waiting_for_gap


def test_queued_marker_only_counts_first() -> None:
    queued = QueuedEvent(request_id="r", seq=0, attempt=0)
    ordering = EventOrdering()
    assert ordering.offer(queued) == [queued]
    assert ordering.offer(queued) == []
    late = EventOrdering()
    late.offer(delta("r", 1, "x"))
    assert late.offer(queued) == []


def test_nothing_after_the_terminal_event() -> None:
    ordering = EventOrdering()
    ordering.offer(done("r", 1, ""))
    assert ordering.offer(delta("r", 2, "late")) == []


def test_a_gap_holds_later_events_back() -> None:
    ordering = EventOrdering()
    assert ordering.offer(delta("r", 2, "b")) == []
    assert ordering.waiting_for_gap
    assert [event.seq for event in ordering.offer(delta("r", 1, "a"))] == [1, 2]
    assert not ordering.waiting_for_gap


def test_a_repeat_is_dropped_but_a_changed_event_at_a_released_seq_is_a_rewrite() -> None:
    """The same seq heard twice (channel and log) carries the same bytes; other bytes mean
    Redis lost the events this subscriber had (a failover) and the job ran over them again."""
    ordering = EventOrdering()
    first, second = delta("r", 1, "a"), delta("r", 2, "b")
    assert ordering.offer(first, hash(b"a")) == [first]
    assert ordering.offer(second, hash(b"b")) == [second]
    assert ordering.offer(first, hash(b"a")) == []  # a plain repeat
    assert ordering.offer(first) == []  # nothing to compare with: taken as a repeat
    with pytest.raises(StreamRewritten, match="seq 2 changed"):
        ordering.offer(reset("r", 2, attempt=2), hash(b"reset"))


def test_a_new_attempt_must_open_with_its_reset() -> None:
    """A new attempt's deltas after the old attempt's, with no reset between them: the reset
    was lost (and with it whatever made the old text void). Attempts never go back either."""
    healthy = EventOrdering()
    events: list[Event] = [
        QueuedEvent(request_id="r", seq=0, attempt=0),
        delta("r", 1, "a"),
        reset("r", 2, attempt=2),
        delta("r", 3, "b", attempt=2),
        done("r", 4, "b", attempt=2),
    ]
    assert [out for event in events for out in healthy.offer(event)] == events
    missed_reset = EventOrdering()
    missed_reset.offer(delta("r", 1, "a"))
    with pytest.raises(StreamRewritten, match="attempt 2 at seq 2 follows attempt 1"):
        missed_reset.offer(delta("r", 2, "b", attempt=2))
    backwards = EventOrdering()
    backwards.offer(delta("r", 1, "a"))
    backwards.offer(reset("r", 2, attempt=3))
    with pytest.raises(StreamRewritten):
        backwards.offer(delta("r", 3, "c", attempt=2))
