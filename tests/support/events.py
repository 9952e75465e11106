"""What a subscriber makes of a request's events: the text it keeps, how the request ended."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, ErrorEvent, Event, ResetEvent


def text_after_last_reset(events: Sequence[Event]) -> str:
    """The text a subscriber keeps: the deltas after the last reset (a new attempt starts the
    text over)."""
    text = ""
    for event in events:
        if isinstance(event, ResetEvent):
            text = ""
        elif isinstance(event, DeltaEvent):
            text += event.new_text
    return text


def terminal_summary(event: Event | None) -> str:
    """``done/<finish_reason>``, ``error/<code>``, or ``none``."""
    if isinstance(event, DoneEvent):
        return f"done/{event.finish_reason}"
    if isinstance(event, ErrorEvent):
        return f"error/{event.code}"
    return "none"
