"""Per API key rate limits and concurrency caps, kept in Redis so every gateway shares them.

One script admits a request: it drops the key's expired in-flight leases, refuses when the
key has ``max_concurrent`` requests in flight, then takes a token from the key's bucket
(``requests_per_minute`` tokens, refilled continuously) or refuses with the wait until the
next one; only a request that passes both checks takes a token and a lease. Time is Redis'
(``TIME``), so gateways with skewed clocks agree. A lease is refreshed while its request
runs and dropped when it ends; a gateway that dies leaves leases that expire on their own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
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

# KEYS[1] the bucket (hash: tokens, at), KEYS[2] the in-flight leases (zset: request id →
# expiry ms). ARGV[1] requests per minute (0: no limit), ARGV[2] max in flight (0: no cap),
# ARGV[3] the request id, ARGV[4] lease ms. Returns {0, 0} admitted, {1, wait_ms} over the
# rate, {2, in_flight} over the cap.
ADMIT: Final = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local rate, cap, lease = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
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


class Quotas:
    """Admission and leases for one gateway's requests."""

    def __init__(
        self, redis: RedisClient, keys: Keys, lease_seconds: float = LEASE_SECONDS
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.lease_ms = int(lease_seconds * 1000)
        self._held: dict[str, ApiKey] = {}  # request id → its key, while it holds a lease

    async def admit(self, key: ApiKey, request_id: str) -> Refusal | None:
        """Take a token and a lease for ``request_id``, or say why not."""
        if key.requests_per_minute is None and key.max_concurrent is None:
            return None
        verdict, figure = await run_script(
            self.redis,
            ADMIT,
            [self.keys.quota(key.name), self.keys.quota_in_flight(key.name)],
            [key.requests_per_minute or 0, key.max_concurrent or 0, request_id, self.lease_ms],
        )
        if verdict == 1:
            return Refusal("rate", retry_after=int(figure) / 1000)
        if verdict == 2:
            return Refusal("concurrency", retry_after=1.0, in_flight=int(figure))
        if key.max_concurrent is not None:
            self._held[request_id] = key
        return None

    async def admit_or_refuse(self, key: ApiKey, request_id: str) -> None:
        """``admit``, with a refusal raised as OpenAI's 429 (and a Retry-After)."""
        refusal = await self.admit(key, request_id)
        if refusal is None:
            return
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

    async def release(self, request_id: str) -> None:
        """Give the lease back (best effort: it expires anyway)."""
        key = self._held.pop(request_id, None)
        if key is None:
            return
        try:
            await self.redis.zrem(self.keys.quota_in_flight(key.name), request_id)
        except REDIS_FAILURES as exc:
            log.warning("quota_lease_not_released", request_id=request_id, error=describe(exc))

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
                await run_script_each(self.redis, REFRESH, calls)
            except REDIS_FAILURES as exc:  # they expire unless a later refresh gets through
                log.warning("quota_leases_not_refreshed", error=describe(exc))
