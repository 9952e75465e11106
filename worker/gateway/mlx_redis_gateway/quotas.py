"""Per API key rate limits and concurrency caps, kept in Redis so every gateway shares them.

One script admits a request: it drops the key's expired in-flight leases, refuses when the
key has ``max_concurrent`` requests in flight, then takes a token from the key's bucket
(``requests_per_minute`` tokens, refilled continuously) or refuses with the wait until the
next one; only a request that passes both checks takes a token and a lease. Time is Redis'
(``TIME``), so gateways with skewed clocks agree. A lease is refreshed while its request
runs and dropped when it ends; a gateway that dies leaves leases that expire on their own.

Reading a request (its answer, or its stream again) is admitted the same way, under a lease
of its own (``read_lease``): reads and resumes count against the key's rate and concurrency
like completions, so a key cannot flood the gateway with reads that use no quota. A read of a
request that still holds its own lease needs no second slot (a client resuming its own
running stream is never refused for it), only a token. Every command goes through the
client's bounded command slots (``Client.command_slot``), so quota traffic waits its turn
instead of failing for want of a connection; a lease whose release fails is retried in the
background for a few seconds before it is left to expire.

A flood from one key costs Redis nothing past its first refusals: a key refused for its rate
is refused by this gateway alone until its next token is due (Redis would say the same:
only time refills a bucket, and other gateways only take from it), and a key that has
``max_concurrent`` leases held by this gateway alone is refused without asking. A client
that comes back before the Retry-After it was given waits on its connection until then (at
most ``EARLY_RETRY_HOLD_SECONDS``, less than an idle connection may wait for its headers)
before its 429: a client that ignores Retry-After cannot make the gateway answer refusals
as fast as it can send them. A client that honours it is never held.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Final

import structlog

from mlx_redis_gateway.api_keys import ApiKey
from mlx_redis_gateway.errors import ApiError
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script, run_script_each
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe

log = structlog.get_logger(__name__)

LEASE_SECONDS: Final = 30.0
# How long a request from a key that came back before its Retry-After is held before its 429.
EARLY_RETRY_HOLD_SECONDS: Final = 3.0

# KEYS[1] the bucket (hash: tokens, at), KEYS[2] the in-flight leases (zset: request id →
# expiry ms). ARGV[1] requests per minute (0: no limit), ARGV[2] max in flight (0: no cap),
# ARGV[3] the lease's id, ARGV[4] lease ms, ARGV[5] (may be empty) a lease that, when held,
# makes this one need no slot of its own. Returns {0, 0} admitted, {1, wait_ms} over the
# rate, {2, in_flight} over the cap.
ADMIT: Final = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local rate, cap, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
if cap > 0 and ARGV[5] ~= '' then
  local held = redis.call('ZSCORE', KEYS[2], ARGV[5])
  if held and tonumber(held) > now then
    cap = 0
  end
end
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  local in_flight = redis.call('ZCARD', KEYS[2])
  if in_flight >= cap then
    return {2, in_flight}
  end
end
if rate > 0 then
  local per_ms = rate / 60000
  local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
  local tokens = tonumber(state[1]) or rate
  local at = tonumber(state[2]) or now
  tokens = math.min(rate, tokens + math.max(now - at, 0) * per_ms)
  if tokens < 1 then
    return {1, math.ceil((1 - tokens) / per_ms)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'at', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil(60000 * 2))
end
if cap > 0 then
  redis.call('ZADD', KEYS[2], now + lease, ARGV[3])
  redis.call('PEXPIRE', KEYS[2], lease * 2)
end
return {0, 0}
"""

# Waits (seconds) before the retries of a lease's release that failed: about 4 s in all, so a
# Redis that refuses briefly does not keep a slot for the lease's whole time.
RELEASE_RETRIES: Final = (0.1, 0.3, 0.6, 1.0, 2.0)

# KEYS[1] the in-flight leases; ARGV[1] lease ms, ARGV[2..] request ids still running here.
REFRESH: Final = """
local t = redis.call('TIME')
local expiry = t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return 0
"""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not admitted: ``rate`` (retry after ``retry_after`` seconds) or
    ``concurrency`` (``in_flight`` requests already run for the key)."""

    reason: str
    retry_after: float
    in_flight: int = 0
    # Refused by this gateway from what it already knew (no Redis command): for ``rate``, the
    # client came back before the Retry-After it was given.
    early: bool = False


def read_lease(request_id: str) -> str:
    """A fresh lease id for one read of ``request_id`` (never a request id itself)."""
    return f"{request_id}/read-{uuid.uuid4().hex[:12]}"


class Quotas:
    """Admission and leases for one gateway's requests."""

    def __init__(
        self,
        slot: Callable[[], AbstractAsyncContextManager[RedisClient]],
        keys: Keys,
        lease_seconds: float = LEASE_SECONDS,
    ) -> None:
        """``slot``: one bounded command slot on the gateway's Redis, per use."""
        self.slot = slot
        self.keys = keys
        self.lease_ms = int(lease_seconds * 1000)
        self._held: dict[str, ApiKey] = {}  # lease id → its key, while it holds a lease
        self._held_per_key: Counter[str] = Counter()
        # Key name → (monotonic time its next token is due, the rate that said so).
        self._rate_refused: dict[str, tuple[float, int | None]] = {}
        self._retrying: set[asyncio.Task[None]] = set()

    async def admit(self, key: ApiKey, lease_id: str, holder: str | None = None) -> Refusal | None:
        """Take a token and a lease ``lease_id``, or say why not. ``holder``: a lease that,
        while held, spares this one a slot of its own (a read of a running request)."""
        if key.requests_per_minute is None and key.max_concurrent is None:
            return None
        known = self._known_refusal(key, holder)
        if known is not None:
            return known
        async with self.slot() as redis:
            verdict, figure = await run_script(
                redis,
                ADMIT,
                [self.keys.quota(key.name), self.keys.quota_in_flight(key.name)],
                [
                    key.requests_per_minute or 0,
                    key.max_concurrent or 0,
                    lease_id,
                    self.lease_ms,
                    holder or "",
                ],
            )
        if verdict == 1:
            wait = int(figure) / 1000
            self._rate_refused[key.name] = (time.monotonic() + wait, key.requests_per_minute)
            return Refusal("rate", retry_after=wait)
        if verdict == 2:
            return Refusal("concurrency", retry_after=1.0, in_flight=int(figure))
        if key.max_concurrent is not None:
            self._held[lease_id] = key
            self._held_per_key[key.name] += 1
        return None

    def _known_refusal(self, key: ApiKey, holder: str | None) -> Refusal | None:
        """A refusal this gateway can give without Redis, or None (then Redis decides)."""
        refused = self._rate_refused.get(key.name)
        if refused is not None:
            until, rate = refused
            wait = until - time.monotonic()
            if wait > 0 and rate == key.requests_per_minute:
                return Refusal("rate", retry_after=wait, early=True)
            del self._rate_refused[key.name]
        # A read of a running request may need no slot of its own: only Redis knows.
        held = self._held_per_key[key.name]
        if holder is None and key.max_concurrent is not None and held >= key.max_concurrent:
            return Refusal("concurrency", retry_after=1.0, in_flight=held, early=True)
        return None

    async def admit_or_refuse(self, key: ApiKey, lease_id: str, holder: str | None = None) -> None:
        """``admit``, with a refusal raised as OpenAI's 429 (and a Retry-After)."""
        refusal = await self.admit(key, lease_id, holder)
        if refusal is None:
            return
        if refusal.early and refusal.reason == "rate":
            hold = min(refusal.retry_after, EARLY_RETRY_HOLD_SECONDS)
            await asyncio.sleep(hold)
            refusal = replace(refusal, retry_after=refusal.retry_after - hold)
        if refusal.reason == "rate":
            message = (
                f"Rate limit reached for API key {key.name!r}: {key.requests_per_minute} "
                f"requests per minute. Retry in {refusal.retry_after:.1f} s."
            )
            code = "rate_limit_exceeded"
        else:
            message = (
                f"Too many requests in flight for API key {key.name!r}: "
                f"{refusal.in_flight} of at most {key.max_concurrent}."
            )
            code = "concurrency_limit_exceeded"
        raise ApiError(429, message, "requests", code=code, retry_after=refusal.retry_after)

    async def release(self, lease_id: str) -> None:
        """Give the lease back; when Redis fails to take it, retry in the background (and
        past that, the lease expires on its own: nothing refreshes it any more)."""
        key = self._held.pop(lease_id, None)
        if key is None:
            return
        self._held_per_key[key.name] -= 1
        if self._held_per_key[key.name] <= 0:
            del self._held_per_key[key.name]
        if await self._release_once(key, lease_id, log_failure=False):
            return
        task = asyncio.create_task(self._release_later(key, lease_id))
        self._retrying.add(task)
        task.add_done_callback(self._retrying.discard)

    async def _release_once(self, key: ApiKey, lease_id: str, *, log_failure: bool) -> bool:
        try:
            async with self.slot() as redis:
                await redis.zrem(self.keys.quota_in_flight(key.name), lease_id)
        except REDIS_FAILURES as exc:
            if log_failure:
                log.warning("quota_lease_not_released", lease=lease_id, error=describe(exc))
            return False
        return True

    async def _release_later(self, key: ApiKey, lease_id: str) -> None:
        for attempt, wait in enumerate(RELEASE_RETRIES, start=1):
            await asyncio.sleep(wait)
            if await self._release_once(key, lease_id, log_failure=attempt == len(RELEASE_RETRIES)):
                return

    async def close(self) -> None:
        """Stop the releases still being retried (their leases expire on their own)."""
        for task in list(self._retrying):
            task.cancel()
        await asyncio.gather(*self._retrying, return_exceptions=True)

    async def keep_leases(self) -> None:
        """Refresh every held lease each third of the lease time, until cancelled."""
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            by_key: dict[str, list[str]] = {}
            for request_id, key in self._held.items():
                by_key.setdefault(key.name, []).append(request_id)
            if not by_key:
                continue
            calls: list[tuple[list[str], list[str | int]]] = [
                ([self.keys.quota_in_flight(name)], [self.lease_ms, *ids])
                for name, ids in by_key.items()
            ]
            try:
                async with self.slot() as redis:
                    await run_script_each(redis, REFRESH, calls)
            except REDIS_FAILURES as exc:  # they expire unless a later refresh gets through
                log.warning("quota_leases_not_refreshed", error=describe(exc))
