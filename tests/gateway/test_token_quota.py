"""Tokens per minute: keys made with the real CLI, two real gateway processes in front of the
module's worker (the tiny model), the bucket counted in the real Redis and shared by both.
What is checked are counts of tokens (the answers' own usage, the bucket in Redis); a time
only ever widens a bound by the refill it may have brought."""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import redis

from mlx_redis_gateway.token_meter import TEMPLATE_TOKENS, TOKENS_PER_MESSAGE
from mlx_redis_protocol.keys import Keys
from tests.gateway.conftest import Fleet
from tests.gateway.test_auth import LONG, MESSAGES, add_key, ask, client, key_name, refused
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.waiting import wait_until

# What the gateway charges MESSAGES before queueing: its bytes, the role, the allowances.
BOUND = len("hi") + len("user") + TOKENS_PER_MESSAGE + TEMPLATE_TOKENS
# The keys of the module: name part → tokens per minute (and more flags).
KEYS = {
    "small": ("--tokens-per-minute", "20", "--requests-per-minute", "50"),
    "streamed": ("--tokens-per-minute", "200"),
    "settled": ("--tokens-per-minute", "2000"),
}


@dataclass
class Metered:
    first: GatewayProcess
    second: GatewayProcess
    secrets: dict[str, str]
    names: dict[str, str]
    fleet: Fleet

    def bucket(self, key: str) -> float:
        """The key's token bucket as last stored (before any refill since)."""
        with redis.Redis.from_url(self.fleet.redis_url) as plain:
            stored = plain.hget(Keys(self.fleet.prefix).quota_tokens(self.names[key]), "tokens")
        return float(stored) if stored is not None else float("inf")


@pytest.fixture(scope="module")
def metered(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Metered]:
    directory = tmp_path_factory.mktemp("metered")
    keys = directory / "keys.toml"
    names = {key: key_name(key) for key in KEYS}
    secrets = {key: add_key(keys, names[key], *flags) for key, flags in KEYS.items()}
    factory = GatewayFactory(directory, fleet.redis_url, fleet.prefix)
    try:
        first = factory.start("--api-keys", str(keys))
        second = factory.start("--api-keys", str(keys))
        yield Metered(first, second, secrets, names, fleet)
    finally:
        factory.stop_all()
        print(factory.report())


def test_a_key_over_its_tokens_per_minute_gets_429_naming_tokens_with_ratelimit_headers(
    metered: Metered,
) -> None:
    """A prompt's bound (78) above the bucket (20) is admitted when the bucket is full; its
    answer's usage settles the charge; the next request waits for a full bucket again."""
    started = time.monotonic()
    secret = metered.secrets["small"]
    first = client(metered.first, secret).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=0
    )
    assert first.usage is not None
    used = first.usage.prompt_tokens + first.usage.completion_tokens
    error = refused(lambda: ask(client(metered.first, secret)), openai.RateLimitError)
    refill = (time.monotonic() - started) * 20 / 60  # at most this much came back since

    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert error.type == "tokens" and "tokens per minute" in error.message
    headers = error.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "20"
    assert headers["x-ratelimit-limit-requests"] == "50"
    assert 48 <= int(headers["x-ratelimit-remaining-requests"]) <= 50  # 1 taken, refilled
    # The bucket holds 20 - used (the worker's count replaced the bound) plus the refill; the
    # next request needs it full (its bound is above 20), 3 s a token. Unsettled, it would
    # hold 20 - 78 - 3 and ask for minutes more.
    low, high = 20 - used, 20 - used + refill
    remaining = int(headers["x-ratelimit-remaining-tokens"])
    assert max(0, math.floor(low)) <= remaining <= max(0, math.floor(high))
    assert (20 - high) * 3 <= int(headers["retry-after"]) <= (20 - low) * 3 + 2
    reset = seconds(headers["x-ratelimit-reset-tokens"])  # until the bucket is full again
    assert (20 - high) * 3 - 0.01 <= reset <= (20 - low) * 3 + 0.01


def test_completion_tokens_are_charged_as_they_stream_and_both_gateways_refuse_the_next(
    metered: Metered,
) -> None:
    """A key over its tokens mid-stream: the stream runs on (not cut), the bucket in Redis
    falls as it streams (not at its end), and both gateways refuse the key's next request."""
    secret = metered.secrets["streamed"]
    with contextlib.closing(
        client(metered.first, secret).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=LONG, temperature=0, stream=True
        )
    ) as stream:
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"
        # Admitted: 200 - BOUND = 122 left, which holds another BOUND: only the streamed
        # tokens (one a chunk at least) take it below.
        wait_until(lambda: metered.bucket("streamed") < 0, 60.0, "the streamed tokens' charges")
        for gateway in (metered.second, metered.first):
            error = refused(functools.partial(ask, client(gateway, secret)), openai.RateLimitError)
            assert error.type == "tokens"
            assert error.response.headers["x-ratelimit-remaining-tokens"] == "0"
        for _ in range(20):  # the stream was not cut
            assert next(chunks).choices[0].finish_reason is None


def test_the_prompt_bound_is_settled_to_the_workers_count_when_a_request_ends(
    metered: Metered,
) -> None:
    """Three prompts whose bound (bytes) is about twice their tokens fit a bucket of about
    two bounds only because each request's ``done`` gives back what its bound overcounted."""
    content = " a" * 450  # 900 bytes; the tiny model's tokenizer makes about 450 tokens
    messages: list[Any] = [{"role": "user", "content": content}]
    bound = len(content) + len("user") + TOKENS_PER_MESSAGE + TEMPLATE_TOKENS
    assert 2 * bound < 2000 < 3 * bound

    for gateway in (metered.first, metered.second, metered.first):
        answer = client(gateway, metered.secrets["settled"]).chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, temperature=0
        )
        assert answer.usage is not None and answer.usage.prompt_tokens < bound * 0.6


def seconds(text: str) -> float:
    """A reset header's duration (``20ms``, ``1.5s``, ``2m3.25s``) in seconds."""
    match = re.fullmatch(r"(?:(\d+)m)?(?:([\d.]+)s)?(?:(\d+)ms)?", text)
    assert match is not None and text, text
    minutes, whole, milliseconds = match.groups()
    return int(minutes or 0) * 60 + float(whole or 0) + int(milliseconds or 0) / 1000
