"""Conformance: the job encoding rules, as a producer in another language meets them.

Every job here is raw msgpack XADDed by hand (protocol/README.md, "Encoding rules" and "Job",
plus the decisions of issue 13); the worker is the real one. A job that fails validation with
a readable request id gets exactly one `error` event (`invalid_job`, message "<code>: ...")
and a dead letter; one without a readable id gets only the dead letter.
"""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest

from tests.protocol.conformance.harness import (
    Served,
    check_dead_letter,
    check_log,
    check_rejected,
    module_worker,
)
from tests.protocol.conformance.raw import pack
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

MAX_STR = 256 * 1024
MAX_MESSAGE = 1024 * 1024
VOCAB = 4096  # the tiny model's vocabulary


served = module_worker("conformance-jobs", lease_seconds=3.0)


def _duplicate_request_id(rid: str) -> bytes:
    """A map whose `request_id` comes twice, an invalid id first: the last one counts."""
    pairs = [("v", 2), ("request_id", "not a valid id"), ("prompt", "hi"), ("request_id", rid)]
    return bytes([0x80 | len(pairs)]) + b"".join(pack(k) + pack(v) for k, v in pairs)


# name -> (job bytes for a request id, the decoder's code)
REJECTED: dict[str, tuple[Callable[[str], bytes], str]] = {
    "no v": (lambda rid: pack({"request_id": rid, "prompt": "hi"}), "missing_field"),
    "v nil": (lambda rid: pack({"v": None, "request_id": rid, "prompt": "hi"}), "missing_field"),
    "v 2": (lambda rid: pack({"v": 2, "request_id": rid, "prompt": "hi"}), "unsupported_version"),
    'v "1"': (
        lambda rid: pack({"v": "1", "request_id": rid, "prompt": "hi"}),
        "unsupported_version",
    ),
    "v 1.0": (
        lambda rid: pack({"v": 1.0, "request_id": rid, "prompt": "hi"}),
        "unsupported_version",
    ),
    "v true": (
        lambda rid: pack({"v": True, "request_id": rid, "prompt": "hi"}),
        "unsupported_version",
    ),
    "extension type": (
        lambda rid: pack(
            {"v": 1, "prompt": "hi", "x": msgpack.ExtType(7, b"ab"), "request_id": rid}
        ),
        "malformed",
    ),
    "integer key": (
        lambda rid: pack({"v": 1, 7: "seven", "request_id": rid, "prompt": "hi"}),
        "malformed",
    ),
    "trailing bytes": (
        lambda rid: pack({"v": 1, "request_id": rid, "prompt": "hi"}) + b"\xc0",
        "malformed",
    ),
    "prompt over 256 KiB": (
        lambda rid: pack({"v": 1, "prompt": "a" * (MAX_STR + 1), "request_id": rid}),
        "limit_exceeded",
    ),
    "max_tokens over 32768": (
        lambda rid: pack({"v": 1, "request_id": rid, "prompt": "hi", "max_tokens": 32769}),
        "limit_exceeded",
    ),
    "message over 1 MiB": (
        lambda rid: pack(
            {"v": 1, "prompt": "hi", "padding": ["x" * (MAX_STR - 64)] * 5, "request_id": rid}
        ),
        "too_large",
    ),
    "two prompt kinds": (
        lambda rid: pack(
            {
                "v": 1,
                "request_id": rid,
                "prompt": "hi",
                "messages": [{"role": "user", "content": "hi"}],
            }
        ),
        "conflicting_fields",
    ),
    "no prompt": (lambda rid: pack({"v": 1, "request_id": rid, "max_tokens": 4}), "missing_field"),
    "bool is not int": (
        lambda rid: pack({"v": 1, "request_id": rid, "prompt": "hi", "max_tokens": True}),
        "invalid_field",
    ),
    "5.0 is not int": (
        lambda rid: pack({"v": 1, "request_id": rid, "prompt": "hi", "max_tokens": 5.0}),
        "invalid_field",
    ),
    "bin is not str": (
        lambda rid: pack({"v": 1, "request_id": rid, "prompt": b"hi"}),
        "invalid_field",
    ),
    "out of range": (
        lambda rid: pack({"v": 1, "request_id": rid, "prompt": "hi", "temperature": -1.0}),
        "invalid_field",
    ),
    "request_id twice": (_duplicate_request_id, "unsupported_version"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_invalid_job_with_a_readable_id_gets_one_error_event_and_a_dead_letter(
    served: Served, case: str
) -> None:
    build, code = REJECTED[case]
    rid = served.rid("bad")
    served.wire.queued_marker(rid)
    job = build(rid)
    if case == "message over 1 MiB":
        assert len(job) > MAX_MESSAGE
    entry_id = served.wire.add_job(job)
    check_rejected(served, rid, entry_id, job, code)


# name -> (job bytes for a request id, the decoder's code); no request id can be read from them
UNREADABLE: dict[str, tuple[Callable[[str], bytes], str]] = {
    "no request_id": (lambda rid: pack({"v": 1, "prompt": 5}), "invalid_field"),
    "invalid request_id": (
        lambda rid: pack({"v": 1, "request_id": f"{rid} x", "prompt": "hi"}),
        "invalid_field",
    ),
    "request_id not a str": (
        lambda rid: pack({"v": 1, "request_id": 12, "prompt": "hi"}),
        "invalid_field",
    ),
    "request_id only nested": (
        lambda rid: pack({"v": 1, "metadata": {"request_id": rid}, "prompt": 5}),
        "invalid_field",
    ),
    "not a map": (lambda rid: pack(["v", 1, "request_id", rid]), "malformed"),
    "not msgpack": (lambda rid: b"\xc1" + rid.encode(), "malformed"),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_invalid_job_without_a_readable_id_is_only_dead_lettered(served: Served, case: str) -> None:
    build, code = UNREADABLE[case]
    wire = served.wire
    rid = served.rid("unreadable")
    before = wire.keys("log:*") | wire.keys("attempt:*") | wire.keys("out:*")
    job = build(rid)
    entry_id = wire.add_job(job)
    dead = wire.dead_letter_of(entry_id)
    after = wire.keys("log:*") | wire.keys("attempt:*") | wire.keys("out:*")
    assert after == before, f"events written for an unreadable job: {after - before}"
    check_dead_letter(served, dead, entry_id, job, code, request_id=None)
    assert wire.job_entry_gone(entry_id)


def test_a_job_without_request_id_still_runs(served: Served) -> None:
    """`request_id` defaults to a random id: the job runs, though nobody can follow it."""
    wire = served.wire
    before = wire.keys("log:*")
    entry_id = wire.add_job({"v": 1, "prompt": "hello", "max_tokens": 2, "temperature": 0})
    wait_until(lambda: wire.job_entry_gone(entry_id), 30, "the job acknowledged")
    assert all(fields.get("entry_id") != entry_id.encode() for _, fields in wire.dead_letters())
    (log,) = wire.keys("log:*") - before
    rid = log.decode().split("{", 1)[1].rstrip("}")
    events = [entry.event for entry in wire.log(rid)]
    assert events[-1]["type"] == "done", events
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), events


def test_unknown_fields_are_ignored(served: Served) -> None:
    rid = served.rid("unknown-fields")
    served.wire.submit(
        rid,
        prompt="hello",
        max_tokens=4,
        temperature=0,
        x_future_field={"nested": [1, "two", None]},
        priority=7,
        ext_looking=b"\x00\x01",
    )
    summary = check_log(served.wire.wait_for_end(rid), rid)
    assert summary.terminal["type"] == "done", summary.terminal
    assert summary.terminal["finish_reason"] in ("stop", "length")
    assert summary.terminal["usage"]["completion_tokens"] <= 4


def test_nil_counts_as_absent(served: Served) -> None:
    """nil prompt kinds do not conflict with the one given; nil sampling fields take the
    worker's defaults; a nil metadata is no metadata."""
    rid = served.rid("nil")
    served.wire.submit(
        rid,
        prompt="hello",
        prompt_token_ids=None,
        messages=None,
        max_tokens=3,
        temperature=None,
        top_p=None,
        seed=None,
        stop=None,
        stop_token_ids=None,
        logprobs=None,
        deadline=None,
        metadata=None,
    )
    summary = check_log(served.wire.wait_for_end(rid), rid)
    assert summary.terminal["type"] == "done", summary.terminal
    assert summary.terminal.get("metadata") is None
    assert summary.terminal["usage"]["completion_tokens"] <= 3


def test_metadata_is_echoed_in_done(served: Served) -> None:
    rid = served.rid("metadata")
    metadata = {"user": "u-1", "tags": ["a", 1, 2.5, True, None], "deep": {"x": {"y": 1}}}
    served.wire.submit(rid, prompt="hello", max_tokens=2, temperature=0, metadata=metadata)
    summary = check_log(served.wire.wait_for_end(rid), rid)
    assert summary.terminal["type"] == "done", summary.terminal
    assert summary.terminal["metadata"] == metadata


def test_prompt_token_ids_and_messages_run(served: Served) -> None:
    wire = served.wire
    by_ids, by_chat = served.rid("ids"), served.rid("chat")
    wire.submit(by_ids, prompt_token_ids=[5, 6, 7, 4095], max_tokens=2, temperature=0)
    wire.submit(
        by_chat,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=2,
        temperature=0,
    )
    for rid, prompt_tokens in ((by_ids, 4), (by_chat, None)):
        summary = check_log(wire.wait_for_end(rid), rid)
        assert summary.terminal["type"] == "done", summary.terminal
        if prompt_tokens is not None:
            assert summary.terminal["usage"]["prompt_tokens"] == prompt_tokens


def test_model_validation_is_invalid_job_with_a_decoder_code(served: Served) -> None:
    """prefix_boundary over a text prompt's token count: checked only once the worker has
    tokenized the prompt, and still answered like a decoder's verdict."""
    wire = served.wire
    rid = served.rid("boundary")
    job = pack({"v": 1, "request_id": rid, "prompt": "hi", "prefix_boundary": 1000})
    wire.queued_marker(rid)
    entry_id = wire.add_job(job)
    dead = check_rejected(served, rid, entry_id, job, "invalid_field")
    message = wire.log(rid)[-1].event["message"]
    assert message.startswith("invalid_field: prefix_boundary 1000 "), message
    assert dead["message"]


def test_engine_error_near_miss_token_ids_beyond_the_vocabulary(served: Served) -> None:
    """`prompt_token_ids` only says "each >= 0"; ids past the model's vocabulary are the
    closest a job comes to failing inside the engine, and they are caught before it runs:
    `invalid_job` (an invalid field of this model), not `engine_error`."""
    wire = served.wire
    rid = served.rid("vocab")
    job = pack({"v": 1, "request_id": rid, "prompt_token_ids": [1, VOCAB, 10**9]})
    wire.queued_marker(rid)
    entry_id = wire.add_job(job)
    check_rejected(served, rid, entry_id, job, "invalid_field")


def test_top_k_beyond_the_vocabulary_is_off(served: Served) -> None:
    """`top_k` is "int >= 0" on the wire; a k at or above the vocabulary size keeps every
    token, so it is the same as 0 (mlx-lm's sampler refuses such a k: it once failed the
    request inside the engine with `engine_error`, the only wire input found to reach that
    code). Same seed, same text as with top_k 0."""
    wire = served.wire
    texts = []
    for top_k in (10**6, 0):
        rid = served.rid(f"top-k-{top_k}")
        wire.submit(rid, prompt="hello", max_tokens=8, temperature=1.0, seed=7, top_k=top_k)
        summary = check_log(wire.wait_for_end(rid), rid)
        assert summary.terminal["type"] == "done", summary.terminal
        texts.append(summary.terminal["output_text"])
    assert texts[0] == texts[1]
