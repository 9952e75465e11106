"""Reading a model's fair share between tenants from Redis: who waits, and the tokens each
tenant was served over the last minutes (what ``mlx-worker models``, the status page and
``stats`` show). The workers' pick script writes these keys; see the spec's Fair share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from redis.exceptions import ResponseError

from mlx_redis_protocol.connection import RedisClient, as_text
from mlx_redis_protocol.identifiers import is_valid_id
from mlx_redis_protocol.keys import FairKeys

# Tokens served per tenant are counted in buckets of a minute, each kept ten minutes: the
# sliding window readers sum.
SERVED_BUCKET_SECONDS: Final = 60
SERVED_WINDOW_SECONDS: Final = 600
# Tenants shown at most per model (those with jobs waiting first, by least service).
MAX_TENANTS_SHOWN: Final = 100


@dataclass(frozen=True, slots=True)
class TenantShare:
    """One tenant of one model: its jobs waiting for a pick, and the tokens its jobs
    generated over the last ``SERVED_WINDOW_SECONDS``."""

    tenant: str
    queued: int
    served_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "queued": self.queued, "served_tokens": self.served_tokens}


def served_bucket(now: float) -> int:
    """The start (epoch seconds) of the bucket ``now`` falls in."""
    return int(now // SERVED_BUCKET_SECONDS) * SERVED_BUCKET_SECONDS


def served_buckets(now: float) -> list[int]:
    """The buckets of the sliding window that ends at ``now``, newest first."""
    newest = served_bucket(now)
    count = SERVED_WINDOW_SECONDS // SERVED_BUCKET_SECONDS
    return [newest - i * SERVED_BUCKET_SECONDS for i in range(count)]


async def tenant_shares(
    redis: RedisClient, fair: FairKeys, *, now: float | None = None
) -> list[TenantShare]:
    """The tenants of one model (``keys.fair(model)``) that have jobs waiting or were served
    within the window: waiting ones first (least service first), then by tokens served. Two
    round trips to the model's slot; empty when fair share was never on."""
    buckets = served_buckets(time.time() if now is None else now)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrange(fair.backlogged, 0, MAX_TENANTS_SHOWN - 1)
        for bucket in buckets:
            pipe.hgetall(fair.served(bucket))
        replies: list[Any] = _readable(await pipe.execute(raise_on_error=False))
    # Written by workers' scripts, yet read as any bytes: what is not a tenant and a count
    # is left out, and a key of another type (someone else's write, repaired by the next
    # pick) reads as empty.
    waiting = [t for t in (as_text(name) for name in replies[0] or []) if is_valid_id(t)]
    served: dict[str, int] = {}
    for counts in replies[1:]:
        for name, tokens in (counts or {}).items():
            tenant, text = as_text(name), as_text(tokens)
            if is_valid_id(tenant) and text.isdigit():
                served[tenant] = served.get(tenant, 0) + int(text)
    queued: list[Any] = []
    if waiting:
        async with redis.pipeline(transaction=False) as pipe:
            for tenant in waiting:
                pipe.zcard(fair.queue(tenant))
            queued = _readable(await pipe.execute(raise_on_error=False))
    shares = [
        TenantShare(tenant, int(count or 0), served.get(tenant, 0))
        for tenant, count in zip(waiting, queued, strict=True)
    ]
    idle = sorted((t for t in served if t not in set(waiting)), key=lambda t: -served[t])
    shares += [TenantShare(tenant, 0, served[tenant]) for tenant in idle]
    return shares[:MAX_TENANTS_SHOWN]


def _readable(replies: list[Any]) -> list[Any]:
    """The replies, a key of another type's (WRONGTYPE) as None; any other error raised."""
    for reply in replies:
        if isinstance(reply, ResponseError) and "WRONGTYPE" not in str(reply):
            raise reply
        if isinstance(reply, BaseException) and not isinstance(reply, ResponseError):
            raise reply
    return [None if isinstance(reply, ResponseError) else reply for reply in replies]
