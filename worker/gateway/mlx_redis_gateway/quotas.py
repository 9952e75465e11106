"""Per API key rate limits, token limits and concurrency caps, kept in Redis so every gateway
shares them.

One script admits a request: it drops the key's expired in-flight leases, refuses when the
key has ``max_concurrent`` requests in flight, then takes a token from the key's request
bucket (``requests_per_minute``, refilled continuously) and the request's prompt bound from
its token bucket (``tokens_per_minute``; ``token_meter`` charges the rest as it streams), or
refuses with the wait until both would admit it; only a request that passes every check takes
anything. Time is Redis' (``TIME``), so gateways with skewed clocks agree. A lease is
refreshed while its request runs and dropped when it ends; a gateway that dies leaves leases
that expire on their own.

Reading a request (its answer, or its stream again) is admitted the same way, under a lease
of its own (``read_lease``): reads and resumes count against the key's rate and concurrency
like completions, so a key cannot flood the gateway with reads that use no quota. A read of a
request that still holds its own lease needs no second slot, only a request token. Every
command goes through the client's bounded command slots (``Client.command_slot``); a lease
whose release fails is retried in the background for a few seconds before it is left to
expire.

A flood from one key costs Redis nothing past its first refusals: a key refused for its rate
is refused by this gateway alone until it would be admitted again (``_remember``), and a key
that has ``max_concurrent`` leases held by this gateway alone is refused without asking. A
client that comes back before the Retry-After it was given waits on its connection until then
(at most ``EARLY_RETRY_HOLD_SECONDS``, less than an idle connection may wait for its headers)
before its 429. A client that honours Retry-After is never held.
"""

from __future__ import annotations

import asyncio
import math
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
from mlx_redis_gateway.quota_scripts import ADMIT, REFRESH
from mlx_redis_gateway.token_meter import TokenMeter
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script, run_script_each
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe

log = structlog.get_logger(__name__)

LEASE_SECONDS: Final = 30.0
# How long a request from a key that came back before its Retry-After is held before its 429.
EARLY_RETRY_HOLD_SECONDS: Final = 3.0

# Waits (seconds) before the retries of a lease's release that failed: about 4 s in all, so a
# Redis that refuses briefly does not keep a slot for the lease's whole time.
RELEASE_RETRIES: Final = (0.1, 0.3, 0.6, 1.0, 2.0)


@dataclass(frozen=True, slots=True)
class Standing:
    """Where a key's buckets stand (``None``: the key has no such limit): their levels, which
    OpenAI's ``x-ratelimit-*`` headers report as what is left and when the bucket is full."""

    requests: float | None = None
    tokens: float | None = None

    def headers(self, key: ApiKey) -> dict[str, str]:
        """``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the key's limits."""
        headers: dict[str, str] = {}
        for name, size, level in (
            ("requests", key.requests_per_minute, self.requests),
            ("tokens", key.tokens_per_minute, self.tokens),
        ):
            if size is None or level is None:
                continue
            headers[f"x-ratelimit-limit-{name}"] = str(size)
            headers[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(level)))
            headers[f"x-ratelimit-reset-{name}"] = duration((size - level) * 60 / size)
        return headers


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not admitted: ``rate`` (its requests per minute) or ``tokens`` (its
    tokens per minute), retry after ``retry_after`` seconds; or ``concurrency``
    (``in_flight`` requests already run for the key)."""

    reason: str
    retry_after: float
    in_flight: int = 0
    # Refused by this gateway from what it already knew (no Redis command): for ``rate`` and
    # ``tokens``, the client came back before the Retry-After it was given.
    early: bool = False
    standing: Standing = Standing()


@dataclass(frozen=True, slots=True)
class _Known:
    """A rate refusal this gateway repeats without Redis until ``until`` (monotonic), while
    the key's limits stay ``limits``."""

    until: float
    limits: tuple[int | None, int | None]
    refusal: Refusal


def read_lease(request_id: str) -> str:
    """A fresh lease id for one read of ``request_id`` (never a request id itself)."""
    return f"{request_id}/read-{uuid.uuid4().hex[:12]}"


def duration(seconds: float) -> str:
    """A wait as OpenAI's reset headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


class Quotas:
    """Admission and leases for one gateway's requests; the token charges of those admitted
    under a tokens-per-minute limit are ``meter``'s."""

    def __init__(
        self,
        slot: Callable[[], AbstractAsyncContextManager[RedisClient]],
        keys: Keys,
        lease_seconds: float = LEASE_SECONDS,
        meter: TokenMeter | None = None,
    ) -> None:
        """``slot``: one bounded command slot on the gateway's Redis, per use."""
        self.slot = slot
        self.keys = keys
        self.lease_ms = int(lease_seconds * 1000)
        self.meter = meter if meter is not None else TokenMeter(slot, keys)
        self.meter.on_refund = self._forget_refusal
        self._held: dict[str, ApiKey] = {}  # lease id → its key, while it holds a lease
        self._held_per_key: Counter[str] = Counter()
        self._refused: dict[str, _Known] = {}  # by key name
        self._retrying: set[asyncio.Task[None]] = set()

    async def admit(
        self, key: ApiKey, lease_id: str, holder: str | None = None, tokens: int = 0
    ) -> Refusal | None:
        """Take a request token, ``tokens`` (the request's prompt bound) and a lease
        ``lease_id``, or say why not. ``holder``: a lease that, while held, spares this one a
        slot of its own (a read of a running request)."""
        limits = (key.requests_per_minute, key.tokens_per_minute)
        if limits == (None, None) and key.max_concurrent is None:
            return None
        known = self._known_refusal(key, holder)
        if known is not None:
            return known
        charge = tokens if key.tokens_per_minute is not None else 0
        async with self.slot() as redis:
            verdict, figure, requests, bucket = await run_script(
                redis,
                ADMIT,
                [
                    self.keys.quota(key.name),
                    self.keys.quota_in_flight(key.name),
                    self.keys.quota_tokens(key.name),
                ],
                [
                    key.requests_per_minute or 0,
                    key.max_concurrent or 0,
                    lease_id,
                    self.lease_ms,
                    holder or "",
                    key.tokens_per_minute or 0,
                    charge,
                ],
            )
        standing = Standing(
            float(requests) if key.requests_per_minute is not None else None,
            float(bucket) if key.tokens_per_minute is not None else None,
        )
        if verdict in (1, 3):
            refusal = Refusal(
                "rate" if verdict == 1 else "tokens", int(figure) / 1000, standing=standing
            )
            self._remember(key, limits, refusal)
            return refusal
        if verdict == 2:
            return Refusal("concurrency", 1.0, in_flight=int(figure), standing=standing)
        if key.max_concurrent is not None:
            self._held[lease_id] = key
            self._held_per_key[key.name] += 1
        if charge:
            self.meter.open(lease_id, key, charge)
        return None

    def _remember(self, key: ApiKey, limits: tuple[int | None, int | None], got: Refusal) -> None:
        """Keep a rate refusal to repeat without Redis: one for requests until the next
        request token is due (only time refills that bucket, other gateways only take from
        it); one for tokens until the bucket holds one token again, when it held less than
        one (a request of any size is refused till then; a refund this gateway makes ends it
        sooner)."""
        wait = got.retry_after
        if got.reason == "tokens":
            level, size = got.standing.tokens, key.tokens_per_minute
            if level is None or size is None or level >= 1:
                return
            wait = (1 - level) * 60 / size
        self._refused[key.name] = _Known(time.monotonic() + wait, limits, got)

    def _forget_refusal(self, key_name: str) -> None:
        known = self._refused.get(key_name)
        if known is not None and known.refusal.reason == "tokens":
            del self._refused[key_name]

    def _known_refusal(self, key: ApiKey, holder: str | None) -> Refusal | None:
        """A refusal this gateway can give without Redis, or None (then Redis decides)."""
        known = self._refused.get(key.name)
        if known is not None:
            wait = known.until - time.monotonic()
            if wait > 0 and known.limits == (key.requests_per_minute, key.tokens_per_minute):
                return replace(known.refusal, retry_after=wait, early=True)
            del self._refused[key.name]
        # A read of a running request may need no slot of its own: only Redis knows.
        held = self._held_per_key[key.name]
        if holder is None and key.max_concurrent is not None and held >= key.max_concurrent:
            return Refusal("concurrency", retry_after=1.0, in_flight=held, early=True)
        return None

    async def admit_or_refuse(
        self, key: ApiKey, lease_id: str, holder: str | None = None, tokens: int = 0
    ) -> None:
        """``admit``, with a refusal raised as OpenAI's 429: its ``type`` names the limit
        (``requests`` or ``tokens``), with ``Retry-After`` and the ``x-ratelimit-*`` headers."""
        refusal = await self.admit(key, lease_id, holder, tokens)
        if refusal is not None:
            await self._refuse(key, refusal, tokens)

    async def refuse_known(self, key: ApiKey) -> None:
        """The 429 a request of ``key`` would get from what this gateway already knows (the
        key came back before its Retry-After, or holds all its slots here), raised before the
        request's body is read; nothing when Redis would have to decide (a key without
        limits is never refused)."""
        refusal = self._known_refusal(key, None)
        if refusal is not None:
            await self._refuse(key, refusal, tokens=None)

    async def _refuse(self, key: ApiKey, refusal: Refusal, tokens: int | None) -> None:
        """Raise ``refusal`` as the 429 (after the early-retry hold); ``tokens``: the request's
        prompt bound, None when its body was not read."""
        if refusal.early and refusal.reason != "concurrency":
            hold = min(refusal.retry_after, EARLY_RETRY_HOLD_SECONDS)
            await asyncio.sleep(hold)
            refusal = replace(refusal, retry_after=refusal.retry_after - hold)
        kind, code = "requests", "rate_limit_exceeded"
        if refusal.reason == "rate":
            message = (
                f"Rate limit reached for API key {key.name!r}: {key.requests_per_minute} "
                f"requests per minute. Retry in {refusal.retry_after:.1f} s."
            )
        elif refusal.reason == "tokens":
            kind = "tokens"
            counts = "" if tokens is None else f", this request's prompt counts up to {tokens}"
            message = (
                f"Rate limit reached for API key {key.name!r} on tokens per minute: limit "
                f"{key.tokens_per_minute}, left {max(0, math.floor(refusal.standing.tokens or 0))}"
                f"{counts}. Retry in {refusal.retry_after:.1f} s."
            )
        else:
            message = (
                f"Too many requests in flight for API key {key.name!r}: "
                f"{refusal.in_flight} of at most {key.max_concurrent}."
            )
            code = "concurrency_limit_exceeded"
        raise ApiError(
            429,
            message,
            kind,
            code=code,
            retry_after=refusal.retry_after,
            extra_headers=refusal.standing.headers(key),
        )

    async def withdraw(self, lease_id: str) -> None:
        """Release the lease of a request admitted but never queued, its tokens given back."""
        await self.meter.refund(lease_id)
        await self.release(lease_id)

    async def release(self, lease_id: str) -> None:
        """Give the lease back; when Redis fails to take it, retry in the background (and
        past that, the lease expires on its own: nothing refreshes it any more)."""
        self.meter.close(lease_id)
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
