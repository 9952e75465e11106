"""What a simulated fleet's processes share without importing the engine (mlx-lm lowers a
process's open-files limit to 2048 when imported, which the bench's Redis would inherit): the
host's settings, the stand-in's words and its token clock."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Final

WORDS: Final = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")
TICKS_PER_SECOND: Final = 10_000
LEASE_SECONDS: Final = 60.0  # the simulated workers' job lease


def word(index: int) -> str:
    """The text of a simulated sequence's token ``index``."""
    return WORDS[index % len(WORDS)] + " "


def expected_text(tokens: int) -> str:
    """The whole text of a simulated request that generated ``tokens`` tokens."""
    return "".join(word(i) for i in range(tokens))


def ticks(epoch: float, now: float | None = None) -> int:
    """A step's time as a token id: 100 µs ticks since ``epoch``."""
    return int(((time.time() if now is None else now) - epoch) * TICKS_PER_SECOND)


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One fleet host process: ``count`` workers, ids ``{id_prefix}{first:05d}`` onwards."""

    redis_url: str
    topology: str  # "standalone" | "cluster"
    prefix: str
    model: str
    id_prefix: str
    first: int
    count: int
    max_concurrency: int
    step_seconds: float
    epoch: float
    heartbeat_interval: float = 5.0
    activity_interval: float = 1.0
    reclaim_interval: float = 10.0
    lease_seconds: float = LEASE_SECONDS
    read_block_ms: int = 0  # 0: the worker's default

    def encode(self) -> str:
        return json.dumps(asdict(self))
