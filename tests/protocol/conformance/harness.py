"""One worker subprocess per test module, and the spec's rules as assertions on raw logs.

The worker is the real ``mlx-worker run --model tiny`` (a ``tests.support`` WorkerFactory);
everything the tests say to it goes through :mod:`tests.protocol.conformance.raw`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_worker.local_redis import RedisServer
from tests.protocol.conformance.raw import LogEntry, Wire, new_id
from tests.support.processes import WorkerFactory, WorkerProcess

# Long enough that a job is still generating when a test acts on it (the tiny model makes
# tens of tokens a second here); every such test stops the job itself.
LONG = 20000
USAGE_INTS = ("prompt_tokens", "completion_tokens", "cached_tokens")
USAGE_NUMBERS = ("ttft_ms", "tokens_per_second", "duration_ms")


@dataclasses.dataclass
class Served:
    """A running worker and a raw connection to its Redis under the module's own prefix."""

    wire: Wire
    worker: WorkerProcess
    factory: WorkerFactory

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    def rid(self, what: str) -> str:
        return new_id(what)

    def stop_long_job(self, request_id: str) -> None:
        """End a LONG job (abort marker) and wait for its terminal event."""
        self.wire.set_abort_marker(request_id)
        self.wire.wait_for_end(request_id, timeout=15)


@contextlib.contextmanager
def serve(
    request: pytest.FixtureRequest,
    redis_url: str,
    directory: Path,
    *,
    worker_id: str = "conformance-w1",
    before_start: Callable[[Wire], None] | None = None,
    **start: Any,
) -> Iterator[Served]:
    """Start one worker on a fresh prefix (after ``before_start`` wrote what it wants there);
    SIGKILL it at the end, printing its log when a test of the module failed."""
    prefix = f"conf{uuid.uuid4().hex[:10]}"
    factory = WorkerFactory(directory, redis_url, prefix)
    wire = Wire(redis_url, prefix)
    failed_before = request.session.testsfailed
    try:
        if before_start is not None:
            before_start(wire)
        worker = factory.start(worker_id, **start)
        yield Served(wire, worker, factory)
    finally:
        factory.kill_all()
        wire.close()
        if request.session.testsfailed > failed_before:
            print(factory.report())


def module_worker(name: str, **start: Any) -> Any:
    """The ``served`` fixture of one conformance module: one worker for all its tests, started
    with ``start`` (WorkerFactory.start's settings, plus ``before_start``)."""

    @pytest.fixture(scope="module")
    def served(
        request: pytest.FixtureRequest,
        redis_server: RedisServer,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[Served]:
        directory = tmp_path_factory.mktemp(name)
        with serve(request, redis_server.url, directory, **start) as running:
            yield running

    return served


# -- the spec's rules, checked on raw events -----------------------------------------------


def is_int(value: object) -> bool:
    """msgpack integer: not a bool, not a float."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An integer or a finite float (NaN and infinities are refused)."""
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def check_common(event: dict[str, Any], request_id: str) -> None:
    """The fields every event has ("Events" table), strictly typed."""
    assert all(isinstance(key, str) for key in event), event
    assert is_int(event.get("v")) and event["v"] == 1, event
    assert isinstance(event.get("type"), str), event
    assert event.get("request_id") == request_id, event
    assert is_int(event.get("seq")) and event["seq"] >= 0, event
    assert is_int(event.get("attempt")) and event["attempt"] >= 0, event


def check_usage(usage: object) -> dict[str, Any]:
    """`usage` as the spec types it: ints, finite numbers, all >= 0."""
    assert isinstance(usage, dict), usage
    for name in ("prompt_tokens", "completion_tokens"):
        assert name in usage, f"usage has no {name}: {usage}"
    for name in USAGE_INTS:
        if name in usage:
            assert is_int(usage[name]) and usage[name] >= 0, f"usage.{name}: {usage!r}"
    for name in USAGE_NUMBERS:
        if name in usage:
            assert is_number(usage[name]) and usage[name] >= 0, f"usage.{name}: {usage!r}"
    return usage


def check_zero_usage(usage: object) -> None:
    """A job that never started: every usage number 0, ttft_ms absent or 0."""
    check_usage(usage)
    assert isinstance(usage, dict)
    for name, value in usage.items():
        if name in USAGE_INTS or name in USAGE_NUMBERS:
            assert value == 0, f"usage.{name} is {value!r} for a job that never started"


@dataclasses.dataclass
class Summary:
    """A finished log, checked against the event rules."""

    entries: list[LogEntry]
    events: list[dict[str, Any]]  # after the queued marker(s)
    terminal: dict[str, Any]
    deltas: list[dict[str, Any]]
    text: str  # the deltas of the last attempt, joined


def check_log(entries: list[LogEntry], request_id: str) -> Summary:
    """Rules 1, 2 and 4 on a request's whole log: the producer's queued marker first; then
    seqs 1..n without gap or repeat, each entry's `seq` field the event's seq; exactly one
    terminal event, last, and the only entry with `end` = 1; a new attempt opens with a
    reset; a done's output_text is its attempt's deltas joined."""
    assert entries, f"{request_id}: empty log"
    head = entries[0].event
    check_common(head, request_id)
    assert (head["type"], head["seq"], head["attempt"]) == ("queued", 0, 0), head
    body = [entry for entry in entries if entry.seq != 0]
    events = [entry.event for entry in body]
    for entry, event in zip(body, events, strict=True):
        check_common(event, request_id)
        assert entry.fields["seq"] == str(event["seq"]).encode(), entry.fields
    seqs = [event["seq"] for event in events]
    assert seqs == list(range(1, len(events) + 1)), f"{request_id}: seqs {seqs}"
    terminals = [i for i, event in enumerate(events) if event["type"] in ("done", "error")]
    assert terminals == [len(events) - 1], f"{request_id}: terminal events at {terminals}"
    assert [entry.end for entry in body] == [False] * (len(body) - 1) + [True], [
        entry.fields.get("end") for entry in body
    ]
    attempts = [event["attempt"] for event in events]
    assert attempts == sorted(attempts) and min(attempts) >= 1, attempts
    for previous, event in itertools.pairwise(events):
        if event["attempt"] != previous["attempt"]:
            assert event["type"] == "reset", f"attempt {event['attempt']} opens with {event}"
    text = ""
    for event in events:
        if event["type"] == "reset":
            text = ""
        elif event["type"] == "delta":
            assert isinstance(event.get("new_text"), str), event
            ids = event.get("new_token_ids")
            assert isinstance(ids, list) and all(is_int(t) and t >= 0 for t in ids), event
            text += event["new_text"]
    terminal = events[-1]
    if terminal["type"] == "done":
        assert terminal.get("finish_reason") in ("stop", "length", "abort", "expired"), terminal
        assert terminal.get("output_text") == text, f"{request_id}: deltas != output_text"
        check_usage(terminal.get("usage"))
    else:
        assert isinstance(terminal.get("code"), str) and terminal["code"], terminal
        assert isinstance(terminal.get("message"), str), terminal
    return Summary(
        entries=entries,
        events=events,
        terminal=terminal,
        deltas=[event for event in events if event["type"] == "delta"],
        text=text,
    )


def check_rejected(
    served: Served, request_id: str, entry_id: str, job: bytes, code: str
) -> dict[str, bytes]:
    """A job with a readable request id that failed validation with decoder ``code``:
    exactly one `error` event (invalid_job, message "<code>: ...") after the marker, and a
    dead letter with the documented fields. Returns the dead letter."""
    wire = served.wire
    dead = wire.dead_letter_of(entry_id)
    summary = check_log(wire.wait_for_end(request_id), request_id)
    assert len(summary.events) == 1, summary.events
    error = summary.terminal
    assert (error["type"], error["seq"], error["attempt"]) == ("error", 1, 1), error
    assert error["code"] == "invalid_job", error
    assert error["message"].startswith(f"{code}: "), error["message"]
    check_dead_letter(served, dead, entry_id, job, code, request_id)
    assert wire.job_entry_gone(entry_id)
    return dead


def check_dead_letter(
    served: Served,
    dead: dict[str, bytes],
    entry_id: str,
    job: bytes,
    code: str,
    request_id: str | None,
    deliveries: int = 1,
) -> None:
    """The dead-letter fields of the spec's "Keys" section."""
    assert dead["job"] == job
    assert dead["code"] == code.encode(), dead
    assert dead["message"], dead
    assert dead["deliveries"] == str(deliveries).encode(), dead
    # A job forwarded from the default stream is recorded under its id there.
    assert dead.get("forwarded_from", dead["entry_id"]) == entry_id.encode(), dead
    assert dead["worker"] == served.worker_id.encode(), dead
    if request_id is None:
        assert "request_id" not in dead, dead
    else:
        assert dead["request_id"] == request_id.encode(), dead
