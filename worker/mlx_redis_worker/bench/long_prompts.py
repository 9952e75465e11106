"""The long-prompt attackers of ``mlx-worker bench isolation``: a tenant inside its quota whose
prompts are long and never hit the prefix cache (issue 35).

``long-prompts``: prompts of about ``LONG_PROMPT_TOKENS`` tokens, up to the attacker key's 4
at once; ``long-prompt-26k``: one prompt of about ``HUGE_PROMPT_TOKENS`` tokens at a time (a
coding agent's ordinary prompt). Each request is a streamed completion of ``ATTACK_MAX_TOKENS``
tokens whose prompt starts with a fresh random salt, so no prefix of it is cached. The
attacker spends its quota as fast as the quota allows and never past it: it keeps the same
token bucket the gateway keeps for its key (``requests_per_minute`` requests, refilled
continuously; the bench gives each such phase a fresh key), so every request is admitted
(200) and what the victim pays for is legitimate work.

The prompt text is built by the bench, which has the model's tokenizer
(``filler_text``), and handed to the attacker process in a file (``--prompt-file``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Any

LONG_PROMPT_TOKENS = 2300  # the tenant B: about 2,300 tokens a prompt
HUGE_PROMPT_TOKENS = 26000  # the one 26k-token request
ATTACK_MAX_TOKENS = 8  # the attacker wants the prefill, not the answer
QUOTA_PER_MINUTE = 30  # the key's requests_per_minute (bench isolation's attacker keys)
# Attack name -> (prompt tokens, requests at once).
LONG_PROMPT_ATTACKS = {
    "long-prompts": (LONG_PROMPT_TOKENS, 4),
    "long-prompt-26k": (HUGE_PROMPT_TOKENS, 1),
}
WORDS = str.split(
    "the model reads every file of the repository and writes a short note on each function "
    "with its arguments its return value and the tests that call it before the agent decides "
    "which change to make next in the code base of the project"
)


def filler_text(tokenizer: Any, tokens: int, seed: int = 0) -> str:
    """Text of about ``tokens`` tokens for ``tokenizer`` (words drawn at random, cut at the
    token count and decoded)."""
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(tokens * 2))
    ids = tokenizer.encode(text)
    while len(ids) < tokens:  # a tokenizer of more than 2 tokens a word: make more
        text += " " + text
        ids = tokenizer.encode(text)
    return str(tokenizer.decode(ids[:tokens]))


class QuotaBucket:
    """The gateway's request bucket for one key, kept on the client's side: ``per_minute``
    requests at most at once, refilled continuously. ``take`` waits until a request would be
    admitted."""

    def __init__(self, per_minute: int) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.tokens = self.capacity
        self.at = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self) -> None:
        async with self.lock:  # one waiter at a time: the others queue behind it
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens < 1:
                # A little past the refill, so the gateway's bucket has it too.
                await asyncio.sleep((1 - self.tokens) / self.rate + 0.05)
                self.tokens, self.at = 1.0, time.monotonic()
            self.tokens -= 1


def streamed_completion(model: str, auth: str, filler: str, max_tokens: int) -> tuple[str, bytes]:
    """A streamed ``/v1/completions`` request (head, body) of ``filler`` after a fresh salt."""
    prompt = f"{uuid.uuid4().hex} {filler}"
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        },
        separators=(",", ":"),
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head, body
