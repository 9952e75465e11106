"""Tokens per minute: what each request admitted under a key's ``tokens_per_minute`` costs it.

The gateway has no tokenizer, so a request is charged, before it is queued, an upper bound
of its prompt's tokens (``prompt_token_bound``): one token per UTF-8 byte of the text the
chat template renders (no tokenizer of a fixture, byte-level BPE or with byte fallback, makes
more tokens than bytes: measured in docs/gateway.md), plus an allowance for the template's own
markup. Its completion tokens are charged as its stream brings them (``count``, sent to
Redis every ``CHARGE_SECONDS`` in one round trip for every key), and its ``done`` event
settles the difference between what was charged and the worker's own count (``settle``:
the usage's prompt and completion tokens), before the answer's end leaves the gateway. A
request that ends in an ``error`` keeps what it was charged.

The bucket lives in Redis beside the key's request bucket (``mlxw:quota:{name}:tokens``), so
every gateway shares it, and it may go below zero: a request admitted with a full bucket
whose prompt bound is above a minute's worth, completion tokens that stream while the bucket
is empty, a template longer than the allowance. A running stream is never cut for it; the
key's next request waits until the bucket holds that request's bound again (hosted APIs
refuse the next request too).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Final

import structlog

from mlx_redis_gateway.api_keys import ApiKey
from mlx_redis_gateway.quota_scripts import CHARGE
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script, run_script_each
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, Event, Job
from mlx_redis_protocol.redis_retry import REDIS_FAILURES, describe

log = structlog.get_logger(__name__)

# How often streamed completion tokens are sent to Redis (one pipelined call for all keys).
CHARGE_SECONDS: Final = 1.0
# The template's markup a prompt's bound allows for, beyond its text's bytes: per request
# (its frame and a default system prompt: SmolLM2's is 30 tokens), per message (role
# markers: 5-6 tokens), per tool (its JSON's wrapping) and per request with tools (the
# template's instructions on calling them).
TEMPLATE_TOKENS: Final = 64
TOKENS_PER_MESSAGE: Final = 8
TOKENS_PER_TOOL: Final = 16
TOOLS_PREAMBLE_TOKENS: Final = 256
# An image's tokens are the model's processor's to count (SmolVLM: 64 per 512-pixel tile plus
# one for the whole, up to 17 tiles): no bound without the model, so an allowance that makes
# an image flood pay at admission for more than its text; the done event settles the rest.
TOKENS_PER_IMAGE: Final = 1024


def prompt_token_bound(job: Job) -> int:
    """At least the tokens ``job``'s prompt renders to, for a template that adds at most the
    allowances above: the bytes of its text, its tool calls' arguments and its tools' JSON."""
    if job.prompt_token_ids is not None:
        return len(job.prompt_token_ids) + TEMPLATE_TOKENS
    if job.input is not None:  # an embedding job: each input with the model's special tokens
        return TEMPLATE_TOKENS + sum(
            TOKENS_PER_MESSAGE + (len(item.encode()) if isinstance(item, str) else len(item))
            for item in job.input
        )
    size = len((job.prompt or "").encode())
    for message in job.messages or ():
        size += TOKENS_PER_MESSAGE + len(message.content.encode()) + len(message.role)
        for call in message.tool_calls or ():
            size += len(call.name.encode()) + len(call.arguments.encode()) + TOKENS_PER_TOOL
    size += TOKENS_PER_IMAGE * len(job.images or ())
    if job.tools:
        size += TOOLS_PREAMBLE_TOKENS
        for tool in job.tools:
            described = {"name": tool.name, "description": tool.description}
            text = json.dumps([described, tool.parameters], ensure_ascii=False, default=str)
            size += len(text.encode()) + TOKENS_PER_TOOL
    return size + TEMPLATE_TOKENS


@dataclass(slots=True)
class _Metered:
    key: ApiKey
    charged: int  # the prompt's bound, taken at admission
    completion: int = 0  # completion tokens counted so far (sent or not)
    seq: int = -1  # the newest event counted (a second reader of the request counts nothing)


class TokenMeter:
    """The token charges of one gateway's requests: opened at admission, counted as events
    pass, settled by the ``done`` event, closed with the request's lease."""

    def __init__(
        self,
        slot: Callable[[], AbstractAsyncContextManager[RedisClient]],
        keys: Keys,
    ) -> None:
        self.slot = slot
        self.keys = keys
        self._open: dict[str, _Metered] = {}  # by request id
        self._unsent: dict[str, tuple[ApiKey, int]] = {}  # by key name: tokens owed
        # Told of each key this gateway gave tokens back to (its known refusals end).
        self.on_refund: Callable[[str], None] | None = None

    def open(self, request_id: str, key: ApiKey, charged: int) -> None:
        self._open[request_id] = _Metered(key, charged)

    def is_open(self, request_id: str) -> bool:
        return request_id in self._open

    def count(self, request_id: str, event: Event) -> None:
        """A delta's completion tokens, owed by the request's key (sent within a second)."""
        metered = self._open.get(request_id)
        if metered is None or event.seq <= metered.seq:
            return
        metered.seq = event.seq
        if isinstance(event, DeltaEvent) and event.new_token_ids:
            metered.completion += len(event.new_token_ids)
            self._owe(metered.key, len(event.new_token_ids))

    async def settle(self, request_id: str, event: Event) -> None:
        """A terminal event: a ``done`` makes the key's charge the worker's own count (the
        usage's prompt and completion tokens), sent now with what the key still owes."""
        metered = self._open.pop(request_id, None)
        if metered is None or event.seq <= metered.seq or not isinstance(event, DoneEvent):
            return
        used = event.usage.prompt_tokens + event.usage.completion_tokens
        self._owe(metered.key, used - metered.charged - metered.completion)
        await self._send([metered.key.name])

    def close(self, request_id: str) -> None:
        """The request is over for this gateway (what it owes is still sent)."""
        self._open.pop(request_id, None)

    async def refund(self, request_id: str) -> None:
        """Give a request's charge back: it was admitted but could not be queued."""
        metered = self._open.pop(request_id, None)
        if metered is not None:
            self._owe(metered.key, -metered.charged - metered.completion)
            await self._send([metered.key.name])

    async def keep_charging(self) -> None:
        """Send what keys owe every ``CHARGE_SECONDS``, until cancelled."""
        while True:
            await asyncio.sleep(CHARGE_SECONDS)
            await self._send(list(self._unsent))

    def _owe(self, key: ApiKey, tokens: int) -> None:
        _, owed = self._unsent.get(key.name, (key, 0))
        self._unsent[key.name] = (key, owed + tokens)

    async def _send(self, names: list[str]) -> None:
        """Charge what the keys ``names`` owe, in one round trip; kept for the next send when
        Redis fails (logged)."""
        owed = [self._unsent.pop(name) for name in names if name in self._unsent]
        calls = [
            ([self.keys.quota_tokens(key.name)], [key.tokens_per_minute, tokens])
            for key, tokens in owed
            if tokens and key.tokens_per_minute is not None
        ]
        if not calls:
            return
        try:
            async with self.slot() as redis:
                if len(calls) == 1:
                    await run_script(redis, CHARGE, *calls[0])
                else:
                    await run_script_each(redis, CHARGE, calls)
        except REDIS_FAILURES as exc:
            log.warning("token_charges_not_sent", keys=len(calls), error=describe(exc))
            for key, tokens in owed:
                self._owe(key, tokens)
            return
        if self.on_refund is not None:
            for key, tokens in owed:
                if tokens < 0:
                    self.on_refund(key.name)
