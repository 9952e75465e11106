"""Conformance: the event rules, subscribing, re-submission and redelivery, spoken raw.

protocol/README.md "Events", "Event rules" 1-7 and "Subscribing without losing an event",
with the issue-13 decisions: every test is a producer / subscriber / fake consumer written
with redis-py and msgpack only, against the real worker.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.protocol.conformance.harness import (
    LONG,
    Served,
    check_common,
    check_dead_letter,
    check_log,
    check_usage,
    check_zero_usage,
    is_int,
    is_number,
    module_worker,
)
from tests.protocol.conformance.raw import LOG_TTL, Subscriber, Wire, pack
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

LEASE = 3.0
SEED = 1234
MAX_DELIVERIES = 2


served = module_worker("conformance-events", lease_seconds=LEASE, max_deliveries=MAX_DELIVERIES)


def _fake_consumer_takes(served: Served, job: bytes, consumer: str = "ghost") -> str:
    """XADD a job to the model's stream and XREADGROUP it as ``consumer`` in one transaction,
    so the worker (blocked in its own XREADGROUP) never sees it new: the fake consumer "dies"
    holding it."""
    wire = served.wire
    names = wire.names
    with wire.redis.pipeline(transaction=True) as pipe:
        pipe.xadd(names.model_jobs, {"job": job})
        pipe.xreadgroup(names.group, consumer, {names.model_jobs: ">"}, count=1)
        entry_id, read = pipe.execute()
    [[_stream, [(read_id, _fields)]]] = read
    assert read_id == entry_id
    assert wire.pending()[entry_id.decode()] == (consumer, 1)
    return entry_id.decode()


# -- rule 1 and subscribing -----------------------------------------------------------------


def test_queued_marker_lets_a_subscriber_follow_from_before_the_start(served: Served) -> None:
    """Rule 1: the producer's marker makes the log exist before the job runs; a subscriber
    that came first gets every event, each once, in seq order, the same bytes as the log."""
    wire = served.wire
    rid = served.rid("early")
    wire.queued_marker(rid)
    subscriber = Subscriber(wire, rid).open()
    wire.add_job({"v": 1, "request_id": rid, "prompt": "hello there", "max_tokens": 8})
    released = subscriber.follow(timeout=30)
    entries = wire.log(rid)
    summary = check_log(entries, rid)
    assert [e["seq"] for e in released] == list(range(len(entries)))
    assert [subscriber.released_raw[e.seq] for e in entries] == [e.raw for e in entries]
    assert released[0]["type"] == "queued"
    assert released[-1] == summary.terminal
    # It subscribed before the job started: every worker event was heard live.
    assert set(subscriber.heard_live) == set(range(1, len(entries)))
    assert subscriber.rewritten == []


def test_late_subscriber_gets_every_event_from_the_log_exactly_once(served: Served) -> None:
    wire = served.wire
    rid = served.rid("late")
    wire.submit(rid, prompt="hello", max_tokens=6, temperature=0)
    entries = wire.wait_for_end(rid)
    check_log(entries, rid)
    subscriber = Subscriber(wire, rid).open()
    released = subscriber.follow(timeout=10)
    assert [e["seq"] for e in released] == list(range(len(entries)))
    assert [subscriber.released_raw[e.seq] for e in entries] == [e.raw for e in entries]
    assert subscriber.heard_live == [] and subscriber.repeats == []


def test_subscriber_joining_mid_run_merges_live_and_log_by_seq(served: Served) -> None:
    """Subscribed while the job runs: what the log already held and what is heard live
    overlap; merged by seq, every event comes out once."""
    wire = served.wire
    rid = served.rid("mid-run")
    wire.submit(rid, prompt="hello", max_tokens=LONG, temperature=0)
    wire.wait_for_deltas(rid, 3)
    subscriber = Subscriber(wire, rid).open()
    wire.set_abort_marker(rid)
    released = subscriber.follow(timeout=15)
    entries = wire.log(rid)
    summary = check_log(entries, rid)
    assert summary.terminal["finish_reason"] == "abort"
    assert [e["seq"] for e in released] == list(range(len(entries)))
    assert [subscriber.released_raw[e.seq] for e in entries] == [e.raw for e in entries]
    assert subscriber.heard_live, "nothing was heard live"


# -- rules 2-4 ------------------------------------------------------------------------------


def test_events_are_numbered_1_to_n_without_gaps_by_attempt_1(served: Served) -> None:
    wire = served.wire
    rid = served.rid("numbering")
    wire.submit(rid, prompt="count with me", max_tokens=10, temperature=0, stream_interval=1)
    summary = check_log(wire.wait_for_end(rid), rid)
    assert [e["seq"] for e in summary.events] == list(range(1, len(summary.events) + 1))
    assert {e["attempt"] for e in summary.events} == {1}
    assert [e["type"] for e in summary.events] == ["delta"] * len(summary.deltas) + ["done"]
    tokens = [t for d in summary.deltas for t in d["new_token_ids"]]
    assert summary.terminal["usage"]["completion_tokens"] == len(tokens)
    if summary.terminal["finish_reason"] == "length":
        assert len(tokens) == 10


def test_every_event_heard_live_is_already_in_the_log(served: Served) -> None:
    """Rule 3: publish and append are one step, so at the moment an event is heard the log
    holds it (same bytes) and every seq before it."""
    wire = served.wire
    rid = served.rid("atomic")
    wire.queued_marker(rid)
    subscriber = Subscriber(wire, rid).open()
    wire.add_job({"v": 1, "request_id": rid, "prompt": "hi", "max_tokens": 16, "temperature": 0})
    subscriber.follow(timeout=30)
    assert len(subscriber.heard_live) >= 2
    assert subscriber.unlogged == []


def test_exactly_one_terminal_event_and_nothing_after_it(served: Served) -> None:
    """Rule 4; and the job entry is acknowledged and deleted once the request ended."""
    wire = served.wire
    rid = served.rid("one-ending")
    entry_id = wire.submit(rid, prompt="hello", max_tokens=4, temperature=0)
    entries = wire.wait_for_end(rid)
    wait_until(lambda: wire.job_entry_gone(entry_id), 10, "the job acknowledged and deleted")
    time.sleep(0.5)
    assert wire.log(rid) == entries
    summary = check_log(entries, rid)
    assert [e.end for e in entries].count(True) == 1
    assert summary.terminal["type"] == "done"


def test_done_usage_is_typed_as_specified(served: Served) -> None:
    wire = served.wire
    rid = served.rid("usage")
    wire.submit(rid, prompt="tell me", max_tokens=6, temperature=0)
    summary = check_log(wire.wait_for_end(rid), rid)
    done = summary.terminal
    assert done["type"] == "done" and isinstance(done["output_text"], str)
    usage = check_usage(done["usage"])
    for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert is_int(usage[name]), usage
    for name in ("ttft_ms", "tokens_per_second", "duration_ms"):
        assert is_number(usage[name]), usage
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == sum(len(d["new_token_ids"]) for d in summary.deltas)
    assert usage["completion_tokens"] > 0
    assert 0 < usage["ttft_ms"] <= usage["duration_ms"]


def _sampled_probe(served: Served, prompt: str) -> list[dict[str, Any]]:
    """The deltas of a seeded run: the same seed and prompt sample the same tokens again."""
    rid = served.rid("probe")
    served.wire.submit(rid, prompt=prompt, max_tokens=3, temperature=1.0, seed=SEED)
    deltas = check_log(served.wire.wait_for_end(rid), rid).deltas
    assert [len(d["new_token_ids"]) for d in deltas] == [1, 1, 1], deltas
    return deltas


def test_a_stop_token_is_not_output_nor_counted(served: Served) -> None:
    """A stop token ends generation without being output: not in new_token_ids, not in the
    text, not in completion_tokens."""
    wire = served.wire
    tokens = [d["new_token_ids"][0] for d in _sampled_probe(served, "the sea is")]
    assert tokens[1] != tokens[0], tokens
    rid = served.rid("stop-token")
    wire.submit(
        rid,
        prompt="the sea is",
        max_tokens=3,
        temperature=1.0,
        seed=SEED,
        stop_token_ids=[tokens[1]],
    )
    summary = check_log(wire.wait_for_end(rid), rid)
    assert summary.terminal["finish_reason"] == "stop"
    assert [t for d in summary.deltas for t in d["new_token_ids"]] == tokens[:1]
    assert summary.terminal["usage"]["completion_tokens"] == 1


def test_a_stop_string_is_cut_from_the_text_but_its_tokens_count(served: Served) -> None:
    wire = served.wire
    deltas = _sampled_probe(served, "once upon")
    first, second = deltas[0]["new_text"], deltas[1]["new_text"]
    assert second and (first + second).find(second) == len(first), deltas
    rid = served.rid("stop-string")
    wire.submit(rid, prompt="once upon", max_tokens=3, temperature=1.0, seed=SEED, stop=[second])
    summary = check_log(wire.wait_for_end(rid), rid)
    done = summary.terminal
    assert done["finish_reason"] == "stop"
    assert done["output_text"] == first
    tokens = [t for d in summary.deltas for t in d["new_token_ids"]]
    assert tokens == [d["new_token_ids"][0] for d in deltas[:2]]
    assert done["usage"]["completion_tokens"] == 2


# -- rule 5: abort --------------------------------------------------------------------------


def test_abort_marker_alone_stops_a_running_job(served: Served) -> None:
    """No control command: the worker polls its running jobs' markers (every 0.5 s)."""
    wire = served.wire
    rid = served.rid("marker-running")
    wire.submit(rid, prompt="go on", max_tokens=LONG, temperature=0)
    wire.wait_for_deltas(rid, 2)
    wire.set_abort_marker(rid)
    started = time.monotonic()
    entries = wire.wait_for_end(rid, timeout=10)
    elapsed = time.monotonic() - started
    summary = check_log(entries, rid)
    assert summary.terminal["type"] == "done"
    assert summary.terminal["finish_reason"] == "abort"
    assert elapsed < 2.0, f"the marker stopped the job after {elapsed:.2f} s"
    usage = summary.terminal["usage"]
    assert 2 <= usage["completion_tokens"] < LONG
    assert usage["completion_tokens"] == sum(len(d["new_token_ids"]) for d in summary.deltas)


def test_abort_marker_before_start_ends_the_job_without_running(served: Served) -> None:
    wire = served.wire
    rid = served.rid("marker-first")
    wire.set_abort_marker(rid)
    entry_id = wire.submit(rid, prompt="never", max_tokens=LONG, metadata={"k": "v"})
    summary = check_log(wire.wait_for_end(rid), rid)
    assert [e["type"] for e in summary.events] == ["done"]
    done = summary.terminal
    assert (done["seq"], done["attempt"], done["finish_reason"]) == (1, 1, "abort")
    assert done["output_text"] == ""
    check_zero_usage(done["usage"])
    wait_until(lambda: wire.job_entry_gone(entry_id), 10, "the job acknowledged")


def test_abort_command_stops_a_running_job(served: Served) -> None:
    wire = served.wire
    rid = served.rid("cmd-running")
    wire.submit(rid, prompt="go on", max_tokens=LONG, temperature=0)
    wire.wait_for_deltas(rid, 2)
    started = time.monotonic()
    reply = wire.command("abort", request_id=rid)
    entries = wire.wait_for_end(rid, timeout=10)
    elapsed = time.monotonic() - started
    assert reply.fields["ok"] is True, reply.fields
    assert reply.fields["result"] == {"aborted": True, "state": "running"}
    assert "error" not in reply.fields
    summary = check_log(entries, rid)
    assert summary.terminal["finish_reason"] == "abort"
    assert elapsed < 1.5, f"the command stopped the job after {elapsed:.2f} s"


def test_abort_command_on_an_unknown_request_is_not_found(served: Served) -> None:
    reply = served.wire.command("abort", request_id=served.rid("nobody"))
    assert reply.fields["ok"] is False
    assert reply.fields["error"]["code"] == "not_found", reply.fields
    assert isinstance(reply.fields["error"]["message"], str)
    assert "result" not in reply.fields


def test_abort_command_on_a_finished_request_says_finished(served: Served) -> None:
    wire = served.wire
    rid = served.rid("cmd-finished")
    wire.submit(rid, prompt="hello", max_tokens=3, temperature=0)
    entries = wire.wait_for_end(rid)
    reply = wire.command("abort", request_id=rid)
    assert reply.fields["ok"] is True, reply.fields
    assert reply.fields["result"] == {"aborted": False, "state": "finished"}
    time.sleep(0.3)
    assert wire.log(rid) == entries


# -- rules 6 and 7 --------------------------------------------------------------------------


def test_deadline_in_the_past_expires_with_zero_usage(served: Served) -> None:
    wire = served.wire
    rid = served.rid("expired")
    entry_id = wire.submit(rid, prompt="too late", max_tokens=8, deadline=time.time() - 5)
    summary = check_log(wire.wait_for_end(rid), rid)
    assert [e["type"] for e in summary.events] == ["done"]
    assert summary.terminal["finish_reason"] == "expired"
    assert summary.terminal["output_text"] == ""
    check_zero_usage(summary.terminal["usage"])
    wait_until(lambda: wire.job_entry_gone(entry_id), 10, "the job acknowledged")


def test_the_log_keeps_its_ttl_after_the_last_event(served: Served) -> None:
    wire = served.wire
    rid = served.rid("ttl")
    wire.submit(rid, prompt="hello", max_tokens=3, temperature=0)
    entries = wire.wait_for_end(rid)
    ttl = wire.redis.ttl(wire.names.log(rid))
    assert LOG_TTL - 30 < ttl <= LOG_TTL, ttl
    attempt_ttl = wire.redis.ttl(wire.names.attempt(rid))
    assert 0 < attempt_ttl <= LOG_TTL, attempt_ttl  # the fence expires with the log
    assert len(entries) >= 2 and entries[0].event["type"] == "queued"


# -- re-submission and redelivery -----------------------------------------------------------


def test_a_finished_request_submitted_again_is_not_run_again(served: Served) -> None:
    """The spec's worked example, twice more after the request ended: the queued marker
    (`XADD log * seq 0 e <bytes>`, `EXPIRE`) and the same job. The worker acknowledges and
    deletes the new entries and writes nothing; a subscriber still sees one ending."""
    wire = served.wire
    rid = served.rid("again")
    job = pack({"v": 1, "request_id": rid, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    wire.queued_marker(rid)
    wire.add_job(job)
    first = wire.wait_for_end(rid)
    finished = check_log(first, rid)
    for _ in range(2):
        wire.queued_marker(rid)
        again = wire.add_job(job)
        wait_until(
            lambda again=again: wire.job_entry_gone(again), 10, "the re-submitted job acknowledged"
        )
    time.sleep(0.3)
    entries = wire.log(rid)
    assert entries[: len(first)] == first
    extra = entries[len(first) :]
    assert [e.event["type"] for e in extra] == ["queued", "queued"]
    assert [e.seq for e in extra] == [0, 0]
    seqs = [e.seq for e in entries if e.seq > 0]
    assert len(seqs) == len(set(seqs)) == len(finished.events)
    assert sum(e.end for e in entries) == 1
    assert wire.redis.xlen(wire.names.jobs) == 0 and wire.pending() == {}
    assert wire.redis.xlen(wire.names.model_jobs) == 0
    released = Subscriber(wire, rid).open().follow(timeout=5)
    assert [e["seq"] for e in released] == list(range(len(finished.events) + 1))


def _log_a_dead_workers_delta(wire: Wire, request_id: str, seq: int, text: str) -> None:
    """A delta of attempt 1 in the log, as the worker that began the job wrote it before it
    died (it published nothing live: nobody listens in these tests)."""
    delta = {
        "v": 1,
        "type": "delta",
        "request_id": request_id,
        "seq": seq,
        "attempt": 1,
        "new_text": text,
        "new_token_ids": [seq],
    }
    wire.redis.xadd(wire.names.log(request_id), {"seq": str(seq).encode(), "e": pack(delta)})


def test_a_job_whose_consumer_died_is_redelivered_and_continues_the_numbering(
    served: Served,
) -> None:
    """A fake consumer took the job, wrote two deltas (as attempt 1) and died without an ack.
    After the lease the worker reclaims it as attempt 2: a reset at seq 3, then its own
    events, numbered on."""
    wire = served.wire
    rid = served.rid("redelivered")
    wire.queued_marker(rid)
    job = pack({"v": 1, "request_id": rid, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    entry_id = _fake_consumer_takes(served, job)
    for seq, text in ((1, "ghost "), (2, "words")):
        _log_a_dead_workers_delta(wire, rid, seq, text)
    started = time.monotonic()
    summary = check_log(wire.wait_for_end(rid, timeout=LEASE + 15), rid)
    assert time.monotonic() - started > LEASE - 1.0  # not before the lease ran out
    events = summary.events
    assert [(e["seq"], e["attempt"]) for e in events[:2]] == [(1, 1), (2, 1)]
    assert (events[2]["type"], events[2]["seq"], events[2]["attempt"]) == ("reset", 3, 2)
    assert {e["attempt"] for e in events[2:]} == {2}
    assert summary.terminal["type"] == "done"
    assert "ghost" not in summary.terminal["output_text"]
    wait_until(lambda: wire.job_entry_gone(entry_id), 10, "the job acknowledged")


def test_abort_command_ends_a_job_whose_worker_died(served: Served) -> None:
    """A worker (a fake consumer here) began the job, wrote a delta and died: its fence names
    it and it has no heartbeat. The abort command ends the request at once as a new attempt
    (its reset, then done/abort), without waiting for the lease; the reclaimed entry is later
    acknowledged without running."""
    wire = served.wire
    rid = served.rid("orphan")
    wire.queued_marker(rid)
    job = pack({"v": 1, "request_id": rid, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    entry_id = _fake_consumer_takes(served, job, "dead-worker")
    wire.redis.set(wire.names.attempt(rid), b"1 dead-worker/0123abcd")
    _log_a_dead_workers_delta(wire, rid, 1, "ghost")
    started = time.monotonic()
    reply = wire.command("abort", request_id=rid)
    summary = check_log(wire.wait_for_end(rid, timeout=5), rid)
    elapsed = time.monotonic() - started
    assert reply.fields["result"] == {"aborted": True, "state": "queued"}, reply.fields
    assert elapsed < 1.5, f"ended after {elapsed:.2f} s"
    assert [(e["type"], e["seq"], e["attempt"]) for e in summary.events] == [
        ("delta", 1, 1),
        ("reset", 2, 2),
        ("done", 3, 2),
    ]
    assert summary.terminal["finish_reason"] == "abort"
    check_zero_usage(summary.terminal["usage"])
    wait_until(
        lambda: wire.job_entry_gone(entry_id), LEASE + 15, "the reclaimed entry acknowledged"
    )
    assert len(wire.log(rid)) == len(summary.events) + 1  # nothing ran after the end


def test_abort_command_leaves_a_job_whose_worker_lives_to_it(served: Served) -> None:
    """The same, but the fence's worker has a heartbeat: it may still be running the job, so
    the command must not take it over (that worker stops it, by this broadcast or the
    marker): `elsewhere`, and nothing written."""
    wire = served.wire
    rid = served.rid("owned")
    wire.queued_marker(rid)
    job = pack({"v": 1, "request_id": rid, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    entry_id = _fake_consumer_takes(served, job, "live-worker")
    wire.redis.set(wire.names.attempt(rid), b"1 live-worker/0123abcd")
    wire.redis.set(wire.names.worker("live-worker"), b"{}", px=60_000)
    try:
        reply = wire.command("abort", request_id=rid)
        assert reply.fields["result"] == {"aborted": False, "state": "elsewhere"}, reply.fields
        assert [e.seq for e in wire.log(rid)] == [0]
    finally:
        wire.redis.delete(wire.names.worker("live-worker"))
    # Its lease runs out: the worker reclaims it and the marker the command set ends it.
    summary = check_log(wire.wait_for_end(rid, timeout=LEASE + 15), rid)
    assert summary.terminal["finish_reason"] == "abort"
    wait_until(lambda: wire.job_entry_gone(entry_id), 10, "the job acknowledged")


def test_a_job_delivered_too_often_is_dead_lettered(served: Served) -> None:
    """Delivered to fake consumers max_deliveries times (XREADGROUP, then XCLAIM, each one
    delivery); the worker's reclaim is delivery 3 > 2: a reset opening attempt 3, an `error`
    event `dead_lettered`, and a dead letter with code `dead_lettered`."""
    wire = served.wire
    names = wire.names
    rid = served.rid("poison")
    wire.queued_marker(rid)
    job = pack({"v": 1, "request_id": rid, "prompt": "hello", "max_tokens": 4})
    entry_id = _fake_consumer_takes(served, job, "ghost-1")
    wire.redis.xclaim(names.model_jobs, names.group, "ghost-2", 0, [entry_id])
    assert wire.pending()[entry_id] == ("ghost-2", MAX_DELIVERIES)
    summary = check_log(wire.wait_for_end(rid, timeout=LEASE + 15), rid)
    reset, error = summary.events
    assert (reset["type"], reset["seq"], reset["attempt"]) == ("reset", 1, MAX_DELIVERIES + 1)
    assert (error["type"], error["seq"], error["attempt"]) == ("error", 2, MAX_DELIVERIES + 1)
    assert error["code"] == "dead_lettered", error
    check_common(error, rid)
    dead = wire.dead_letter_of(entry_id)
    check_dead_letter(
        served, dead, entry_id, job, "dead_lettered", rid, deliveries=MAX_DELIVERIES + 1
    )
    assert wire.job_entry_gone(entry_id)
