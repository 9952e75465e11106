"""The wire side of models: key names and slots, the `model` field of jobs and control
commands, and the heartbeat JSON (a current worker's and an older one's)."""

from __future__ import annotations

import json
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from redis.crc import key_slot

from mlx_redis_protocol.codec_control import decode_command, encode_command
from mlx_redis_protocol.codec_job import decode_job, encode_job, readable_model, readable_request_id
from mlx_redis_protocol.errors import ERROR_CODES, ProtocolError
from mlx_redis_protocol.heartbeat import Heartbeat, ServedModel, decode_heartbeat
from mlx_redis_protocol.keys import JobStream, Keys
from mlx_redis_protocol.messages import ControlCommand, Job


def test_model_stream_names_and_slots() -> None:
    keys = Keys()
    stream = keys.model_stream("qwen3-8b")
    assert stream == JobStream("mlxw:jobs:{qwen3-8b}", "mlxw", "mlxw:dead:{qwen3-8b}", "qwen3-8b")
    assert keys.default_stream == JobStream("mlxw:jobs", "mlxw", "mlxw:dead:{mlxw:jobs}", None)
    # Each stream's dead letters share its slot: one script moves an entry between them.
    assert key_slot(stream.stream.encode()) == key_slot(stream.dead.encode())
    assert key_slot(stream.stream.encode()) == key_slot(b"qwen3-8b")
    # The registry shares the default stream's slot: a reader finds workers and models on
    # one node with one round trip.
    assert (keys.workers, keys.models) == ("mlxw:workers:{mlxw:jobs}", "mlxw:models:{mlxw:jobs}")
    assert (
        key_slot(keys.workers.encode()) == key_slot(keys.models.encode()) == key_slot(b"mlxw:jobs")
    )


@pytest.mark.parametrize("model", ["", "a b", "a{b}", "x" * 129, "a*"])
def test_invalid_model_names_are_refused_as_keys(model: str) -> None:
    with pytest.raises(ValueError, match="model name"):
        Keys().model_stream(model)


def test_the_job_model_round_trips_and_is_optional() -> None:
    job = Job(request_id="r1", prompt="hi", model="qwen3-8b")
    assert decode_job(encode_job(job)) == job
    assert msgpack.unpackb(encode_job(job))["model"] == "qwen3-8b"
    plain = Job(request_id="r1", prompt="hi")
    assert "model" not in msgpack.unpackb(encode_job(plain))
    assert decode_job(encode_job(plain)).model is None


def _job(**fields: Any) -> bytes:
    data: bytes = msgpack.packb({"v": 1, "request_id": "r1", "prompt": "hi", **fields})
    return data


@pytest.mark.parametrize("model", ["", "a b", "x" * 129, 5, ["a"], True])
def test_an_invalid_job_model_is_invalid_field(model: object) -> None:
    with pytest.raises(ProtocolError) as raised:
        decode_job(_job(model=model))
    assert raised.value.code == "invalid_field"
    assert "model" in raised.value.message
    # The request id stays readable: the worker can answer the request with invalid_job.
    assert readable_request_id(_job(model=model)) == "r1"


def test_nil_model_counts_as_absent() -> None:
    assert decode_job(_job(model=None)).model is None


def test_readable_model_reads_even_an_invalid_job() -> None:
    assert readable_model(_job(model="m1", v=2, max_tokens=-1)) == "m1"
    assert readable_model(_job(model="a b")) is None
    assert readable_model(_job(model=5)) is None
    assert readable_model(_job()) is None
    assert readable_model(b"\xc1") is None


def test_the_control_model_round_trips() -> None:
    command = ControlCommand(kind="stats", id="c1", reply_to="mlxw:reply:{c1}", model="m1")
    assert decode_command(encode_command(command)) == command
    plain = ControlCommand(kind="stats", id="c1", reply_to="mlxw:reply:{c1}")
    assert "model" not in msgpack.unpackb(encode_command(plain))
    assert decode_command(encode_command(plain)).model is None


def test_an_invalid_control_model_is_invalid_field() -> None:
    data = msgpack.packb(
        {"v": 1, "kind": "stats", "id": "c1", "reply_to": "mlxw:reply:{c1}", "model": "a b"}
    )
    with pytest.raises(ProtocolError) as raised:
        decode_command(data)
    assert raised.value.code == "invalid_field"


def test_unknown_model_is_an_error_code() -> None:
    assert "unknown_model" in ERROR_CODES
    assert ProtocolError("unknown_model", "x").code == "unknown_model"


def test_a_heartbeat_round_trips() -> None:
    beat = Heartbeat(
        worker_id="w1",
        pid=42,
        started_at=1700000000.5,
        in_flight=3,
        default_model="a",
        models={
            "a": ServedModel(
                max_concurrency=8, free_slots=6, in_flight=2, media=("image", "video")
            ),
            "b": ServedModel(max_concurrency=4, free_slots=3, in_flight=1),
        },
        version="1.2.3",
    )
    encoded = json.loads(beat.encode())
    # Older readers show one model: `model` names the default.
    assert encoded["model"] == encoded["default_model"] == "a"
    assert encoded["models"]["b"] == {
        "max_concurrency": 4,
        "free_slots": 3,
        "in_flight": 1,
        "media": [],  # a text-only model
    }
    assert encoded["models"]["a"]["media"] == ["image", "video"]
    assert decode_heartbeat(beat.encode()) == beat
    assert decode_heartbeat(beat.encode().encode()) == beat
    assert beat.serves("b") and not beat.serves("c")


def test_an_older_workers_heartbeat_serves_no_model() -> None:
    old = json.dumps(
        {"worker_id": "w0", "pid": 7, "started_at": 1.0, "in_flight": 1, "model": "/m/smol"}
    )
    beat = decode_heartbeat(old)
    assert beat is not None
    assert (beat.worker_id, beat.pid, beat.in_flight) == ("w0", 7, 1)
    assert beat.default_model == "/m/smol"
    assert beat.models == {} and beat.version is None
    assert not beat.serves("/m/smol")


@pytest.mark.parametrize(
    "raw", [None, b"", b"1", b"{}", b"[1]", b"\xff", b'{"worker_id": 5}', b"not json"]
)
def test_values_that_are_not_heartbeats_decode_to_none(raw: bytes | None) -> None:
    assert decode_heartbeat(raw) is None


def test_wrongly_typed_heartbeat_fields_read_as_absent() -> None:
    raw = json.dumps(
        {
            "worker_id": "w1",
            "pid": "x",
            "started_at": True,
            "in_flight": 1.5,
            "default_model": 3,
            "models": {"a": {"max_concurrency": "8"}, "b": 5, "c": {"free_slots": 2}},
            "version": 2,
        }
    )
    beat = decode_heartbeat(raw)
    assert beat is not None
    assert (beat.pid, beat.started_at, beat.in_flight, beat.default_model) == (0, 0.0, 0, None)
    assert beat.models == {
        "a": ServedModel(max_concurrency=0, free_slots=0, in_flight=0),
        "c": ServedModel(max_concurrency=0, free_slots=2, in_flight=0),
    }
    assert beat.version is None
