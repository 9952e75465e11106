"""A job's ``speculative`` field on the wire: round trips and the decoder's refusals."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.messages import Job


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "prompt_lookup"},
        {"method": "prompt_lookup", "num_draft_tokens": 1},
        {"method": "prompt_lookup", "num_draft_tokens": 16},
        {"method": "draft_model", "num_draft_tokens": 3},
        {"method": "off"},
    ],
)
def test_speculative_round_trips(speculative: dict[str, Any]) -> None:
    job = Job(request_id="r1", prompt="hi", speculative=speculative)
    decoded = decode_job(encode_job(job))
    assert decoded == job
    assert decoded.speculative is not None and dict(decoded.speculative) == speculative


def test_a_job_without_speculative_has_none_and_nil_counts_as_absent() -> None:
    assert decode_job(encode_job(Job(request_id="r1", prompt="hi"))).speculative is None
    assert "speculative" not in msgpack.unpackb(encode_job(Job(request_id="r1", prompt="x")))
    data = msgpack.packb(
        {"v": 1, "request_id": "r1", "prompt": "hi", "speculative": {"method": "off", "x": None}}
    )
    assert decode_job(data).speculative == {"method": "off"}


# (speculative, code, what the message names)
REFUSALS: list[tuple[Any, str, str]] = [
    ("prompt_lookup", "invalid_field", "job.speculative "),
    ({}, "missing_field", "job.speculative.method"),
    ({"method": "medusa"}, "invalid_field", "job.speculative.method"),
    ({"method": 3}, "invalid_field", "job.speculative.method"),
    ({"method": "prompt_lookup", "num_draft_tokens": 0}, "invalid_field", "num_draft_tokens"),
    ({"method": "prompt_lookup", "num_draft_tokens": 17}, "limit_exceeded", "num_draft_tokens"),
    ({"method": "prompt_lookup", "num_draft_tokens": "4"}, "invalid_field", "num_draft_tokens"),
    ({"method": "prompt_lookup", "draft": 4}, "invalid_field", "job.speculative.draft"),
]


@pytest.mark.parametrize(("speculative", "code", "names"), REFUSALS)
def test_bad_speculative_is_refused_with_its_field(speculative: Any, code: str, names: str) -> None:
    data = msgpack.packb({"v": 1, "request_id": "r1", "prompt": "hi", "speculative": speculative})
    with pytest.raises(ProtocolError) as caught:
        decode_job(data)
    assert caught.value.code == code, caught.value
    assert names in str(caught.value)
    assert caught.value.request_id == "r1"
