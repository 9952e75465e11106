"""The seq ordering on its own: any arrival order, any repeats, one clean sequence out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.messages import Event, QueuedEvent
from protocol.ordering import EventOrdering
from tests.protocol.helpers import delta, done


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
