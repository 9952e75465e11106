"""Conformance: a worker with one slot (max_concurrency 1), so jobs really wait in the queue.

Jobs queued before any worker existed are served (workers create the group at id 0); the
`abort` command ends a job that waits behind a running one; `usage` timings count from the
job's arrival (its stream entry id), so they include the wait.
"""

from __future__ import annotations

import time

import pytest
import redis

from tests.protocol.conformance.harness import (
    LONG,
    Served,
    check_log,
    check_zero_usage,
    module_worker,
)
from tests.protocol.conformance.raw import Wire, entry_ms, new_id
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

EARLY = new_id("before-the-worker")


def _queue_before_the_worker(wire: Wire) -> None:
    """A producer that comes first: no group exists yet, and it creates none."""
    with pytest.raises(redis.ResponseError):
        wire.redis.xinfo_groups(wire.names.jobs)
    wire.submit(EARLY, prompt="hello", max_tokens=3, temperature=0)


served = module_worker(
    "conformance-queue", max_concurrency=1, lease_seconds=3.0, before_start=_queue_before_the_worker
)


def test_the_worker_creates_the_group_at_0_and_serves_jobs_queued_before_it(
    served: Served,
) -> None:
    wire = served.wire
    summary = check_log(wire.wait_for_end(EARLY), EARLY)
    assert summary.terminal["type"] == "done"
    groups = wire.redis.xinfo_groups(wire.names.jobs)
    assert [g["name"] for g in groups] == [wire.names.group.encode()]


def _start_running(served: Served, what: str) -> str:
    rid = served.rid(what)
    served.wire.submit(rid, prompt="go on", max_tokens=LONG, temperature=0)
    served.wire.wait_for_deltas(rid, 2)
    return rid


def test_abort_command_ends_a_job_queued_behind_a_running_one(served: Served) -> None:
    wire = served.wire
    running = _start_running(served, "running")
    queued = served.rid("queued")
    entry_id = wire.submit(queued, prompt="never", max_tokens=8, metadata={"k": 1})
    time.sleep(0.3)
    assert entry_id not in wire.pending(), "precondition: the job waits in the stream"

    started = time.monotonic()
    reply = wire.command("abort", request_id=queued)
    entries = wire.wait_for_end(queued, timeout=5)
    elapsed = time.monotonic() - started
    assert reply.fields["ok"] is True, reply.fields
    assert reply.fields["result"] == {"aborted": True, "state": "queued"}
    summary = check_log(entries, queued)
    assert [e["type"] for e in summary.events] == ["done"]
    done = summary.terminal
    assert (done["finish_reason"], done["output_text"]) == ("abort", "")
    check_zero_usage(done["usage"])
    assert "metadata" not in done  # no worker read the job
    assert elapsed < 1.5, f"the queued job ended {elapsed:.2f} s after the command"
    assert not any(e.end for e in wire.log(running)), "the running job was stopped too"

    reply = wire.command("abort", request_id=running)
    assert reply.fields["result"] == {"aborted": True, "state": "running"}, reply.fields
    assert check_log(wire.wait_for_end(running), running).terminal["finish_reason"] == "abort"
    # The queued entry is taken once the slot frees, acknowledged and deleted without running.
    wait_until(lambda: wire.job_entry_gone(entry_id), 10, "the aborted job's entry acknowledged")
    time.sleep(0.3)
    assert wire.log(queued) == entries


def test_usage_timings_count_from_the_jobs_arrival(served: Served) -> None:
    """ttft_ms and duration_ms count from the ms in the job's entry id, so a job that waited
    behind another reports at least that wait."""
    wire = served.wire
    running = _start_running(served, "ahead")
    waiting = served.rid("behind")
    arrival = entry_ms(wire.submit(waiting, prompt="hello", max_tokens=4, temperature=0))
    time.sleep(1.5)
    wire.set_abort_marker(running)
    ahead_end = wire.wait_for_end(running, timeout=10)[-1].ms
    entries = wire.wait_for_end(waiting, timeout=30)
    summary = check_log(entries, waiting)
    usage = summary.terminal["usage"]
    waited = ahead_end - arrival  # it could not start before the job ahead ended
    assert waited >= 1400, waited
    assert usage["ttft_ms"] >= waited, (usage, waited)
    assert usage["duration_ms"] >= usage["ttft_ms"], usage
    # ...and not from anything earlier than the arrival: the end is when done was logged.
    assert usage["duration_ms"] <= entries[-1].ms - arrival + 50, (usage, entries[-1].ms - arrival)
