"""Stored Responses (``store: true``): a response, its input items and the conversation before
them, kept in Redis per API key for ``StoreLimits.ttl_seconds``, so ``previous_response_id``
continues from it and ``GET``/``DELETE /v1/responses/{id}`` find it.

A key's records share its Cluster slot (``mlxw:response:{key_name}:RESPONSE_ID``, beside its
index ``mlxw:responses:{key_name}`` and total ``…:bytes``), so one script stores a record and,
when the key's records would pass ``max_key_bytes``, drops its oldest first: a key cannot fill
Redis, and a bound reached costs that key its oldest conversations, never a refusal. A record
over ``max_response_bytes`` is not kept (its answer says ``store: false``). Each record expires
on its own (its key's TTL); the index forgets expired ones at the next stores
(``PRUNE_BATCH`` a store). Records are JSON; one that does not decode as a record (anyone with
write access to the prefix could write one) reads as missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

import structlog

from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script

log = structlog.get_logger(__name__)

# The scope of a gateway without API keys: its callers are one.
ANONYMOUS: Final = "anonymous"
DAY_SECONDS: Final = 86400


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """How long a stored response is kept (0: ``store`` is ignored, nothing is kept), and how
    big one may be and all of one API key's together."""

    ttl_seconds: int = 30 * DAY_SECONDS
    max_response_bytes: int = 8 * 1024 * 1024
    max_key_bytes: int = 128 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.ttl_seconds < 0:
            raise ValueError(f"--store-ttl must be 0 or more seconds, got {self.ttl_seconds}")
        if not 1 <= self.max_response_bytes <= self.max_key_bytes:
            raise ValueError(
                "--store-max-response-bytes must be at least 1 and at most "
                f"--store-max-key-bytes, got {self.max_response_bytes} and {self.max_key_bytes}"
            )

    @property
    def enabled(self) -> bool:
        return self.ttl_seconds > 0


DEFAULT_STORE_LIMITS: Final = StoreLimits()


# Expired records a store forgets from its key's index at most (the rest at the next ones).
PRUNE_BATCH: Final = 1000

# KEYS[1] the key's index (zset: "SIZE/ID" -> expiry ms), KEYS[2] its total (bytes), KEYS[3]
# the record's key. ARGV[1] the response id, ARGV[2] the record, ARGV[3] its TTL (ms), ARGV[4]
# the key's bound (bytes), ARGV[5] what a record's key is + its id. Forgets expired records,
# drops the oldest while the new one would not fit, stores it. Returns the records dropped.
STORE: Final = f"""
local PRUNE_BATCH = {PRUNE_BATCH}
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local total = tonumber(redis.call('GET', KEYS[2])) or 0
local function size_of(member)
  return tonumber(string.match(member, '^(%d+)/')) or 0
end
-- At most PRUNE_BATCH a call: a key back after its thousands expired costs one call no more.
local expired = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, PRUNE_BATCH)
for _, member in ipairs(expired) do
  total = total - size_of(member)
end
if #expired > 0 then
  redis.call('ZREM', KEYS[1], unpack(expired))
end
local old = redis.call('GET', KEYS[3])
if old then
  redis.call('ZREM', KEYS[1], #old .. '/' .. ARGV[1])
  total = total - #old
end
local size, bound, dropped = #ARGV[2], tonumber(ARGV[4]), 0
while total + size > bound do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not oldest then
    total = 0
    break
  end
  redis.call('ZREM', KEYS[1], oldest)
  redis.call('DEL', ARGV[5] .. string.match(oldest, '^%d+/(.*)$'))
  total = total - size_of(oldest)
  dropped = dropped + 1
end
local expiry = now + tonumber(ARGV[3])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[1], expiry, size .. '/' .. ARGV[1])
-- The index and total live as long as the latest record (a gateway may keep them longer).
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2]) or expiry
redis.call('SET', KEYS[2], math.max(total, 0) + size, 'PX', math.max(last, expiry) - now)
redis.call('PEXPIRE', KEYS[1], math.max(last, expiry) - now)
return dropped
"""

# KEYS as STORE's; ARGV[1] the response id. Returns 1 if it was stored (and is no more).
DELETE: Final = """
local old = redis.call('GET', KEYS[3])
if not old then
  return 0
end
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[1], #old .. '/' .. ARGV[1])
local total = (tonumber(redis.call('GET', KEYS[2])) or 0) - #old
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
else
  redis.call('SET', KEYS[2], math.max(total, 0), 'KEEPTTL')
end
return 1
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A stored response: the response object as answered, the conversation before its input
    (``context``: items of earlier responses it continues), and its own input items."""

    response: dict[str, Any]
    context: list[dict[str, Any]]
    input_items: list[dict[str, Any]]

    def conversation(self) -> list[dict[str, Any]]:
        """What a response that continues from this one has before its own input: the
        context, the input, the output."""
        return [*self.context, *self.input_items, *self.response.get("output", [])]

    def encode(self) -> bytes:
        record = {"response": self.response, "context": self.context, "input": self.input_items}
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> StoredResponse | None:
        """The record, or None for bytes that are not one."""
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(record, dict):
            return None
        response, context = record.get("response"), record.get("context")
        items = record.get("input")
        if not (
            isinstance(response, dict)
            and isinstance(response.get("id"), str)
            and isinstance(response.get("output"), list)
            and _items(context)
            and _items(items)
            and _items(response["output"])
        ):
            return None
        return cls(response, context, items)


def _items(value: object) -> TypeGuard[list[dict[str, Any]]]:
    """Items as stored: objects, each with its id (what ``input_items`` pages by)."""
    return isinstance(value, list) and all(
        isinstance(item, dict) and isinstance(item.get("id"), str) for item in value
    )


def encoded_size(items: list[dict[str, Any]]) -> int:
    """The bytes ``items`` take in a record."""
    return len(json.dumps(items, separators=(",", ":")).encode())


class ResponseStore:
    """Stored responses in Redis, each in the scope of the API key that made it."""

    def __init__(
        self,
        slot: Callable[[], AbstractAsyncContextManager[RedisClient]],
        keys: Keys,
        limits: StoreLimits,
    ) -> None:
        """``slot``: one bounded command slot on the gateway's Redis, per use."""
        self.slot = slot
        self.keys = keys
        self.limits = limits

    def _keys(self, scope: str, response_id: str) -> list[str]:
        keys = self.keys
        return [
            keys.stored_responses(scope),
            keys.stored_responses_bytes(scope),
            keys.stored_response(scope, response_id),
        ]

    async def save(self, scope: str, stored: StoredResponse) -> bool:
        """Keep ``stored`` (its key's oldest dropped if need be); False when it is over the
        bound of one response, or storing is off."""
        response_id = stored.response["id"]
        record = stored.encode()
        if not self.limits.enabled or len(record) > self.limits.max_response_bytes:
            log.info("response_not_stored", response_id=response_id, size=len(record), scope=scope)
            return False
        args = [
            response_id,
            record,
            self.limits.ttl_seconds * 1000,
            self.limits.max_key_bytes,
            self.keys.stored_response_base(scope),
        ]
        async with self.slot() as redis:
            dropped = await run_script(redis, STORE, self._keys(scope, response_id), args)
        if dropped:
            log.info("stored_responses_dropped", scope=scope, dropped=dropped, for_=response_id)
        return True

    async def load(self, scope: str, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, expired, deleted, another scope's)."""
        async with self.slot() as redis:
            raw = await redis.get(self.keys.stored_response(scope, response_id))
        if raw is None:
            return None
        stored = StoredResponse.decode(raw)
        if stored is None:
            log.warning("stored_response_unreadable", response_id=response_id, scope=scope)
        return stored

    async def delete(self, scope: str, response_id: str) -> bool:
        """Forget a stored response; False when there was none."""
        async with self.slot() as redis:
            deleted = await run_script(redis, DELETE, self._keys(scope, response_id), [response_id])
        return bool(deleted)
