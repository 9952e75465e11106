"""Round trips of every message, and the decoders' verdicts on specific invalid input."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from mlx_redis_protocol.codec_control import decode_command, decode_reply
from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.errors import ERROR_CODES, ProtocolError
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import Job
from tests.protocol.messages_samples import KINDS

SAMPLES = [
    pytest.param(sample, encode, decode, id=f"{name}-{index}")
    for name, samples, encode, decode in KINDS
    for index, sample in enumerate(samples)
]


@pytest.mark.parametrize(("sample", "encode", "decode"), SAMPLES)
def test_round_trip(sample: Any, encode: Any, decode: Any) -> None:
    assert decode(encode(sample)) == sample


@pytest.mark.parametrize(("sample", "encode", "decode"), SAMPLES)
def test_unknown_fields_are_ignored(sample: Any, encode: Any, decode: Any) -> None:
    fields = msgpack.unpackb(encode(sample))
    fields["added_in_a_later_version"] = {"anything": [1, 2]}
    decoded = decode(msgpack.packb(fields))
    if decoded.__class__.__name__ == "UnknownEvent":  # keeps extras: it may be printed
        return
    assert decoded == sample


def pack(**fields: Any) -> bytes:
    data: bytes = msgpack.packb({"v": 1, **fields})
    return data


def job(**fields: Any) -> bytes:
    return pack(**{"request_id": "r1", "prompt": "hi", **fields})


def event(**fields: Any) -> bytes:
    return pack(**{"type": "delta", "request_id": "r1", "seq": 1, "attempt": 1, **fields})


INVALID_JOBS = [
    ("not a map", msgpack.packb([1, 2]), "malformed"),
    ("garbage", b"\xc1\xc1", "malformed"),
    ("trailing bytes", job() + b"\x00", "malformed"),
    ("extension type", msgpack.packb({"v": 1, "x": msgpack.ExtType(5, b"ab")}), "malformed"),
    ("no version", msgpack.packb({"request_id": "r1", "prompt": "hi"}), "missing_field"),
    ("version nil", job(v=None), "missing_field"),  # nil counts as absent
    ("version 2", job(v=2), "unsupported_version"),
    ("version as str", job(v="1"), "unsupported_version"),
    ("version as bool", job(v=True), "unsupported_version"),
    ("no prompt", pack(request_id="r1"), "missing_field"),
    ("two prompts", job(prompt_token_ids=[1]), "conflicting_fields"),
    ("empty prompt", job(prompt=""), "invalid_field"),
    ("prompt not str", job(prompt=5), "invalid_field"),
    ("empty token ids", pack(request_id="r1", prompt_token_ids=[]), "invalid_field"),
    ("negative token", pack(request_id="r1", prompt_token_ids=[1, -1]), "invalid_field"),
    ("bool token", pack(request_id="r1", prompt_token_ids=[True]), "invalid_field"),
    ("too many tokens", pack(request_id="r1", prompt_token_ids=[1] * 33), "limit_exceeded"),
    ("message not map", pack(request_id="r1", messages=["hi"]), "invalid_field"),
    ("message no role", pack(request_id="r1", messages=[{"content": "x"}]), "missing_field"),
    ("max_tokens 0", job(max_tokens=0), "invalid_field"),
    ("max_tokens negative", job(max_tokens=-5), "invalid_field"),
    ("max_tokens huge", job(max_tokens=2**63), "limit_exceeded"),
    ("max_tokens float", job(max_tokens=5.0), "invalid_field"),
    ("max_tokens bool", job(max_tokens=True), "invalid_field"),
    ("temperature NaN", job(temperature=float("nan")), "invalid_field"),
    ("temperature inf", job(temperature=float("inf")), "invalid_field"),
    ("temperature < 0", job(temperature=-0.1), "invalid_field"),
    ("top_p > 1", job(top_p=1.5), "invalid_field"),
    ("top_k < 0", job(top_k=-1), "invalid_field"),
    ("min_p < 0", job(min_p=-0.1), "invalid_field"),
    ("repetition_penalty 0", job(repetition_penalty=0), "invalid_field"),
    ("seed negative", job(seed=-1), "invalid_field"),
    ("stop not list", job(stop="x"), "invalid_field"),
    ("stop empty string", job(stop=[""]), "invalid_field"),
    ("too many stops", job(stop=["x"] * 17), "limit_exceeded"),
    ("stop too long", job(stop=["x" * 257]), "limit_exceeded"),
    ("logprobs 21", job(logprobs=21), "limit_exceeded"),
    ("stream_interval 0", job(stream_interval=0), "invalid_field"),
    ("prefix_boundary negative", job(prefix_boundary=-1), "invalid_field"),
    ("prefix_boundary other word", job(prefix_boundary="user"), "invalid_field"),
    ("prefix_boundary system, plain prompt", job(prefix_boundary="system"), "invalid_field"),
    (
        "prefix_boundary system, no system turn",
        pack(
            request_id="r1", messages=[{"role": "user", "content": "x"}], prefix_boundary="system"
        ),
        "invalid_field",
    ),
    (
        "prefix_boundary past the tokens",
        pack(request_id="r1", prompt_token_ids=[1, 2], prefix_boundary=3),
        "invalid_field",
    ),
    ("deadline str", job(deadline="soon"), "invalid_field"),
    ("metadata list", job(metadata=[1]), "invalid_field"),
    ("metadata NaN", job(metadata={"x": float("nan")}), "invalid_field"),
    ("metadata bytes", job(metadata={"x": b"raw"}), "invalid_field"),
    ("metadata too deep", job(metadata={"a": [[[[[[[[[1]]]]]]]]]}), "limit_exceeded"),
    ("metadata too big", job(metadata={"x": "y" * 20000}), "limit_exceeded"),
    ("string over limit", job(prompt="x" * 300_000), "limit_exceeded"),
    ("request id with braces", job(request_id="a}b"), "invalid_field"),
    ("request id too long", job(request_id="a" * 129), "invalid_field"),
    ("request id int", job(request_id=5), "invalid_field"),
]


@pytest.mark.parametrize(("data", "code"), [pytest.param(d, c, id=n) for n, d, c in INVALID_JOBS])
def test_invalid_jobs(data: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_job(data, Limits(max_prompt_tokens=32, max_array_len=32))
    assert caught.value.code == code
    assert code in ERROR_CODES


def test_job_errors_name_the_request_once_it_is_known() -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_job(job(temperature=-1))
    assert caught.value.request_id == "r1"
    assert "temperature" in caught.value.message
    with pytest.raises(ProtocolError) as caught:
        decode_job(job(request_id="bad id"))
    assert caught.value.request_id is None


def test_job_without_request_id_gets_one() -> None:
    first = decode_job(pack(prompt="hi"))
    second = decode_job(pack(prompt="hi"))
    assert first.request_id and second.request_id and first.request_id != second.request_id


def test_too_large_is_refused_before_unpacking() -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_job(job(prompt="x" * 2000), Limits(max_message_bytes=1000))
    assert caught.value.code == "too_large"


def test_sampling_kwargs_use_lists_and_skip_unset_fields() -> None:
    decoded = decode_job(encode_job(Job(request_id="r", prompt="p", top_k=5, stop=("a",))))
    assert decoded.sampling_kwargs() == {"top_k": 5, "stop": ["a"]}
    assert decoded.chat_messages() is None
    assert not decoded.is_expired(now=0)
    assert Job(request_id="r", prompt="p", deadline=10).is_expired(now=11)


INVALID_EVENTS = [
    ("no type", pack(request_id="r1", seq=1, attempt=1), "missing_field"),
    ("no seq", event(seq=None), "missing_field"),
    ("negative seq", event(seq=-1), "invalid_field"),
    ("delta seq 0", event(seq=0), "invalid_field"),
    ("queued seq 1", event(type="queued"), "invalid_field"),
    ("no new_text", event(), "missing_field"),
    ("token ids not list", event(new_text="", new_token_ids=5), "invalid_field"),
    (
        "logprob NaN",
        event(new_text="", logprobs=[{"token_id": 1, "logprob": float("nan")}]),
        "invalid_field",
    ),
    (
        "logprob positive",
        event(new_text="", logprobs=[{"token_id": 1, "logprob": 0.5}]),
        "invalid_field",
    ),
    (
        "token bytes not binary",
        event(new_text="", logprobs=[{"token_id": 1, "logprob": -1.0, "bytes": "a"}]),
        "invalid_field",
    ),
    (
        "token bytes too long",
        event(new_text="", logprobs=[{"token_id": 1, "logprob": -1.0, "bytes": b"x" * 1025}]),
        "invalid_field",
    ),
    (
        "top_bytes not one per pair",
        event(
            new_text="",
            logprobs=[
                {"token_id": 1, "logprob": -1.0, "top_logprobs": [[1, -1.0]], "top_bytes": []}
            ],
        ),
        "invalid_field",
    ),
    (
        "done bad reason",
        event(type="done", finish_reason="bored", output_text="", usage={}),
        "invalid_field",
    ),
    ("done no usage", event(type="done", finish_reason="stop", output_text=""), "missing_field"),
    (
        "usage negative",
        event(
            type="done",
            finish_reason="stop",
            output_text="",
            usage={"prompt_tokens": -1, "completion_tokens": 0},
        ),
        "invalid_field",
    ),
    ("error no code", event(type="error", message="m"), "missing_field"),
    ("reset attempt 0", event(type="reset", attempt=0), "invalid_field"),
    ("bad request id", event(request_id="{x}"), "invalid_field"),
]


@pytest.mark.parametrize(("data", "code"), [pytest.param(d, c, id=n) for n, d, c in INVALID_EVENTS])
def test_invalid_events(data: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_event(data)
    assert caught.value.code == code


INVALID_COMMANDS = [
    ("no kind", pack(id="c", reply_to="x"), "missing_field"),
    ("no reply_to", pack(kind="ping", id="c"), "missing_field"),
    ("abort without request", pack(kind="abort", id="c", reply_to="x"), "missing_field"),
    ("save without name", pack(kind="cache_save", id="c", reply_to="x"), "missing_field"),
    (
        "name with slash",
        pack(kind="cache_load", id="c", reply_to="x", name="../x"),
        "invalid_field",
    ),
    (
        "name starting with dot",
        pack(kind="cache_save", id="c", reply_to="x", name=".x"),
        "invalid_field",
    ),
    ("bad id", pack(kind="ping", id="a b", reply_to="x"), "invalid_field"),
]


@pytest.mark.parametrize(
    ("data", "code"), [pytest.param(d, c, id=n) for n, d, c in INVALID_COMMANDS]
)
def test_invalid_commands(data: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_command(data)
    assert caught.value.code == code


INVALID_REPLIES = [
    ("no ok", pack(id="c", worker_id="w"), "missing_field"),
    ("ok as int", pack(id="c", ok=1, worker_id="w"), "invalid_field"),
    ("failed without error", pack(id="c", ok=False, worker_id="w"), "missing_field"),
    (
        "ok with error",
        pack(id="c", ok=True, worker_id="w", error={"code": "x", "message": ""}),
        "conflicting_fields",
    ),
    ("result not a map", pack(id="c", ok=True, worker_id="w", result=[1]), "invalid_field"),
]


@pytest.mark.parametrize(
    ("data", "code"), [pytest.param(d, c, id=n) for n, d, c in INVALID_REPLIES]
)
def test_invalid_replies(data: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_reply(data)
    assert caught.value.code == code
