"""The embedding job and the ``embedding`` event on the wire: what encodes, what decodes,
what is refused (with the decoder's codes), and OpenAI's input shapes as job inputs."""

from __future__ import annotations

import struct

import pytest

from mlx_redis_protocol.codec_events import decode_event, encode_event
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.embeddings import EmbeddingCollector, EmbeddingFailed, embedding_inputs
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import DoneEvent, EmbeddingEvent, Job, ResetEvent, Usage
from mlx_redis_protocol.wire import pack


def vector(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def test_an_embedding_job_round_trips() -> None:
    job = Job(request_id="e-1", input=("hello", (5, 6, 7)), dimensions=64, model="m")
    assert decode_job(encode_job(job)) == job


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        ({"input": []}, "invalid_field", "at least 1 item"),
        ({"input": [""]}, "invalid_field", "input[0] must not be empty"),
        ({"input": ["a", 5]}, "invalid_field", "input[1] must be a string or an array of token"),
        ({"input": [[1, -2]]}, "invalid_field", "must hold non-negative integers"),
        ({"input": ["a"] * 3}, "limit_exceeded", "more than 2 items"),
        ({"input": ["a"], "prompt": "b"}, "conflicting_fields", "prompt and input"),
        ({"prompt": "b", "dimensions": 8}, "invalid_field", "is for embedding jobs"),
        ({"input": ["a"], "dimensions": 0}, "invalid_field", "dimensions must be >= 1"),
    ],
)
def test_an_embedding_job_that_cannot_run_is_refused(
    fields: dict[str, object], code: str, words: str
) -> None:
    data = pack({"v": 1, "request_id": "e-2", **fields}, "job")
    with pytest.raises(ProtocolError) as refused:
        decode_job(data, Limits(max_embedding_inputs=2))
    assert refused.value.code == code and words in str(refused.value)
    assert refused.value.request_id == "e-2"


def test_the_embedding_event_round_trips_and_refuses_what_is_no_vector() -> None:
    event = EmbeddingEvent(
        request_id="e-3", seq=2, attempt=1, index=4, vectors=(vector(1, 0), vector(0, 1))
    )
    assert decode_event(encode_event(event)) == event
    common = {"v": 1, "type": "embedding", "request_id": "e-3", "seq": 2, "attempt": 1, "index": 0}
    for data in ([], [b"abc"], [vector(1, 0), vector(1)], ["text"]):
        with pytest.raises(ProtocolError, match="data must hold vectors of one length"):
            decode_event(pack({**common, "data": data}, "event"))


def test_openais_input_shapes_become_job_inputs() -> None:
    assert embedding_inputs("hi") == ("hi",)
    assert embedding_inputs(["a", "b"]) == ("a", "b")
    assert embedding_inputs([1, 2, 3]) == ((1, 2, 3),)
    assert embedding_inputs([[1, 2], [3]]) == ((1, 2), (3,))
    for bad in ([], [1, [2]], [1.5], [True], {"a": 1}):
        with pytest.raises(ProtocolError):
            embedding_inputs(bad)  # type: ignore[arg-type]


def test_the_collector_keeps_the_last_attempts_vectors_in_order() -> None:
    collector = EmbeddingCollector("e-4")
    usage = Usage(prompt_tokens=7, completion_tokens=0)
    for event in (
        EmbeddingEvent(request_id="e-4", seq=1, attempt=1, index=0, vectors=(vector(9),)),
        ResetEvent(request_id="e-4", seq=2, attempt=2),
        EmbeddingEvent(request_id="e-4", seq=3, attempt=2, index=0, vectors=(vector(1),)),
        EmbeddingEvent(request_id="e-4", seq=4, attempt=2, index=1, vectors=(vector(2),)),
        DoneEvent(
            request_id="e-4", seq=5, attempt=2, finish_reason="stop", output_text="", usage=usage
        ),
    ):
        collector.feed(event)
    result = collector.result(inputs=2)
    assert result.as_floats() == [[1.0], [2.0]]
    assert result.as_base64() == ["AACAPw==", "AAAAQA=="]
    with pytest.raises(EmbeddingFailed, match="with 2 vectors"):
        collector.result(inputs=3)
