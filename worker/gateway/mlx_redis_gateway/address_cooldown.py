"""A client address that keeps sending oversized requests cools down, as fail2ban does for nginx.

A 431 or 413 costs the gateway little (the guard refuses before parsing), but a client that
opens a new connection as soon as the last is reset can make 1,500 such refusals a second,
and on a small host the accepts, reads and resets take CPU from the engine beside it. So an
address refused for size ``refusals`` times within ``seconds`` cools down for ``seconds``:
its next connections are answered 429 at once (no parser, no route, no Redis), their reading
paused, and they are held open until the cool-down ends, then reset. A client that reads the
429 and closes (any HTTP client does) is gone at once; one pushing a body without reading is
stuck on a full socket buffer, holding a file descriptor and using no CPU, instead of making
the next connection. At most ``max_held`` connections an address are held (and
``MAX_HELD_TOTAL`` in all, so the kernel's socket buffers stay bounded); beyond that a
connection is reset right at accept (``SO_LINGER`` 0).

The table of addresses is an LRU of ``MAX_ADDRESSES``: bounded whatever the number of
clients; a full table drops an address that is not cooling down first, so a crowd of
addresses refused once each does not flush a cooling one out. An IPv6 client counts per /64
(``connection_table.address_group``), the block one host is given.

Behind a reverse proxy every client has the proxy's address: there the proxy
enforces the size limits (ops/README.md) and ``--cooldown-after-refusals 0`` turns this off.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import structlog

log = structlog.get_logger(__name__)

MAX_ADDRESSES: Final = 4096
MAX_HELD_TOTAL: Final = 256
# Oldest addresses looked at for one that is not cooling down, when the table is full.
EVICTION_SEARCH: Final = 64
# Cool-downs that began are logged at most this often (with the count and the last address):
# many addresses starting one each must not become a flood of log lines.
COOLDOWN_LOG_SECONDS: Final = 1.0


@dataclass(slots=True)
class _Address:
    # Monotonic times of the recent size refusals, oldest first.
    refusals: deque[float] = field(default_factory=deque)
    cooling_until: float = 0.0
    held: int = 0


class AddressCooldowns:
    """Size refusals per client address, and the cool-downs they start."""

    def __init__(
        self,
        refusals: int,
        seconds: float,
        max_held: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refusals = refusals  # 0: never cool down
        self.seconds = seconds
        self.max_held = max_held
        self._clock = clock
        self._addresses: OrderedDict[str, _Address] = OrderedDict()
        self._held_total = 0
        self._started = 0  # cool-downs begun since the last log line
        self._logged_at = 0.0

    def refused(self, address: str) -> None:
        """Note a size refusal (431 or 413) of ``address``'s request."""
        if self.refusals == 0:
            return
        now = self._clock()
        entry = self._addresses.get(address)
        if entry is None:
            entry = self._addresses[address] = _Address()
            if len(self._addresses) > MAX_ADDRESSES:
                self._evict(now)
        else:
            self._addresses.move_to_end(address)
        entry.refusals.append(now)
        while entry.refusals[0] <= now - self.seconds:
            entry.refusals.popleft()
        if len(entry.refusals) >= self.refusals:
            entry.refusals.clear()
            entry.cooling_until = now + self.seconds
            self._started += 1
            if now - self._logged_at >= COOLDOWN_LOG_SECONDS:
                log.warning(
                    "address_cooling_down",
                    address=address,
                    seconds=self.seconds,
                    count=self._started,
                )
                self._started, self._logged_at = 0, now

    def _evict(self, now: float) -> None:
        """Drop the oldest address that is not cooling down (among the oldest
        ``EVICTION_SEARCH``; else the oldest): thousands of addresses sending one oversized
        request each do not flush a cooling one out of the table."""
        for searched, (address, entry) in enumerate(self._addresses.items()):
            if searched >= EVICTION_SEARCH:
                break
            if entry.cooling_until <= now and not entry.held:
                del self._addresses[address]
                return
        self._addresses.popitem(last=False)

    def cooling(self, address: str) -> float:
        """Seconds left of ``address``'s cool-down; 0 when it is not cooling down."""
        entry = self._addresses.get(address)
        if entry is None:
            return 0.0
        return max(0.0, entry.cooling_until - self._clock())

    def hold(self, address: str) -> bool:
        """Take one of ``address``'s held connections; False when none is left."""
        entry = self._addresses.get(address)
        if entry is None or entry.held >= self.max_held or self._held_total >= MAX_HELD_TOTAL:
            return False
        entry.held += 1
        self._held_total += 1
        return True

    def release(self, address: str) -> None:
        """A held connection of ``address`` closed."""
        self._held_total -= 1
        entry = self._addresses.get(address)
        if entry is not None:  # evicted meanwhile (and perhaps back): never below 0
            entry.held = max(0, entry.held - 1)
