"""A worker's activity: the JSON value of ``mlxw:activity:{worker_id}`` (see protocol/README.md).

Workers rewrite it about once a second while they live (same TTL as the heartbeat): the
requests they are generating, each with its tokens so far, and the tokens they generated per
time bucket over the last minutes. Buckets start at multiples of ``bucket_seconds`` since the
epoch, so the buckets of different workers line up and a reader adds them up. Kept apart from
the heartbeat, which producers read on every catalogue check and which stays small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from mlx_redis_protocol.heartbeat import int_or_zero, number_or_zero, worker_document
from mlx_redis_protocol.identifiers import is_valid_id


@dataclass(frozen=True, slots=True)
class RequestActivity:
    """One request a worker is generating."""

    request_id: str
    model: str | None
    attempt: int
    tokens: int  # completion tokens of this attempt so far
    started_at: float  # when this attempt opened, epoch seconds


@dataclass(frozen=True, slots=True)
class Activity:
    worker_id: str
    at: float  # when it was written, epoch seconds (the worker's clock)
    bucket_seconds: int
    # (bucket start in epoch seconds, tokens generated in it), oldest first; empty buckets
    # may be left out.
    buckets: tuple[tuple[int, int], ...] = ()
    requests: tuple[RequestActivity, ...] = field(default_factory=tuple)

    def encode(self) -> str:
        return json.dumps(
            {
                "worker_id": self.worker_id,
                "at": self.at,
                "bucket_seconds": self.bucket_seconds,
                "buckets": [list(bucket) for bucket in self.buckets],
                "requests": [
                    {
                        "request_id": r.request_id,
                        "model": r.model,
                        "attempt": r.attempt,
                        "tokens": r.tokens,
                        "started_at": r.started_at,
                    }
                    for r in self.requests
                ],
            },
            separators=(",", ":"),
        )


def decode_activity(raw: bytes | str | None) -> Activity | None:
    """The activity in ``raw``; None for a value that is not one. Entries of the wrong shape
    are left out rather than fail the whole view."""
    value = worker_document(raw)
    if value is None:
        return None
    bucket_seconds = value.get("bucket_seconds")
    if (
        not isinstance(bucket_seconds, int)
        or isinstance(bucket_seconds, bool)
        or bucket_seconds < 1
    ):
        return None
    buckets = tuple(
        (item[0], item[1])
        for item in _list(value.get("buckets"))
        if isinstance(item, list) and len(item) == 2 and _is_int(item[0]) and _is_int(item[1])
    )
    requests = tuple(
        request
        for request in (_request(item) for item in _list(value.get("requests")))
        if request is not None
    )
    return Activity(
        worker_id=value["worker_id"],
        at=number_or_zero(value.get("at")),
        bucket_seconds=bucket_seconds,
        buckets=buckets,
        requests=requests,
    )


def _request(item: Any) -> RequestActivity | None:
    if not isinstance(item, dict):
        return None
    request_id, model = item.get("request_id"), item.get("model")
    if not isinstance(request_id, str) or not is_valid_id(request_id):
        return None
    return RequestActivity(
        request_id=request_id,
        model=model if isinstance(model, str) else None,
        attempt=int_or_zero(item.get("attempt")),
        tokens=int_or_zero(item.get("tokens")),
        started_at=number_or_zero(item.get("started_at")),
    )


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
