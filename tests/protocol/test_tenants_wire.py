"""The wire side of tenants: the job's `tenant` (who a job runs for; workers share a model's
slots fairly between tenants) and `priority` (the order of one tenant's jobs) fields."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from mlx_redis_protocol.client import build_job
from mlx_redis_protocol.codec_job import decode_job, encode_job, readable_request_id
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.messages import Job


def _job(**fields: Any) -> bytes:
    data: bytes = msgpack.packb({"v": 1, "request_id": "r1", "prompt": "hi", **fields})
    return data


def test_the_tenant_round_trips_and_is_optional() -> None:
    job = Job(request_id="r1", prompt="hi", tenant="team-a")
    assert decode_job(encode_job(job)) == job
    assert msgpack.unpackb(encode_job(job))["tenant"] == "team-a"
    plain = Job(request_id="r1", prompt="hi")
    assert "tenant" not in msgpack.unpackb(encode_job(plain))
    assert decode_job(encode_job(plain)).tenant is None
    assert decode_job(_job(tenant=None)).tenant is None  # nil counts as absent


@pytest.mark.parametrize("tenant", ["", "a b", "a{b}", "x" * 129, 5, ["a"], True])
def test_an_invalid_tenant_is_invalid_field_and_keeps_the_request_id(tenant: object) -> None:
    with pytest.raises(ProtocolError) as raised:
        decode_job(_job(tenant=tenant))
    assert raised.value.code == "invalid_field"
    assert "tenant" in raised.value.message
    assert raised.value.request_id == "r1"
    assert readable_request_id(_job(tenant=tenant)) == "r1"


def test_the_client_sets_the_tenant_as_a_job_option() -> None:
    job = build_job(
        prompt="hi",
        prompt_token_ids=None,
        messages=None,
        request_id="r1",
        options={"tenant": "team-b"},
    )
    assert job.tenant == "team-b"
    with pytest.raises(ProtocolError, match="tenant"):
        build_job(
            prompt="hi",
            prompt_token_ids=None,
            messages=None,
            request_id="r1",
            options={"tenant": "no spaces"},
        )


def test_the_priority_round_trips_within_its_range() -> None:
    for priority in (-100, -10, 0, 10, 100):
        job = Job(request_id="r1", prompt="hi", priority=priority)
        assert decode_job(encode_job(job)).priority == priority
    assert decode_job(_job()).priority is None


@pytest.mark.parametrize("priority", [-101, 101, 1.5, "high", True])
def test_a_priority_out_of_range_or_not_an_integer_is_invalid_field(priority: object) -> None:
    with pytest.raises(ProtocolError) as raised:
        decode_job(_job(priority=priority))
    assert raised.value.code == "invalid_field"
    assert "priority" in raised.value.message


def test_a_tenant_of_invalid_utf8_is_named_as_such() -> None:
    """Raw bytes in `tenant` (a msgpack str of invalid UTF-8) are the field's fault, said so,
    not "not valid msgpack"; the request id stays readable for the error event."""
    valid = msgpack.packb({"v": 1, "request_id": "r1", "prompt": "x", "tenant": "ab"})
    data = valid.replace(b"\xa2ab", b"\xa2\xff\xfe")
    with pytest.raises(ProtocolError) as refused:
        decode_job(data)
    assert refused.value.code == "invalid_field"
    assert "`tenant` is not valid UTF-8" in str(refused.value)
    assert "msgpack" not in str(refused.value)
    assert readable_request_id(data) == "r1"
