"""When a worker registers in the fleet's registry (protocol/mlx_redis_protocol/registry.py).

With every heartbeat while the registry lists up to ``REGISTRATIONS_PER_BEAT`` workers; in a
larger fleet less often (``workers / REGISTRATIONS_PER_BEAT`` heartbeats apart, at most
``REFRESH_MAX_SECONDS``, at random between half that and that), so the fleet still writes
the registry at least ``REGISTRATIONS_PER_BEAT`` times per heartbeat interval: a registry
key someone broke is repaired as fast as before, at a fraction of the cost (at 1,000 idle
workers, 22 s apart on average instead of 5: the registry script was the largest part of
their upkeep). At once when the heartbeat key was gone (a start, an expiry during an
outage, a Redis that lost its data) or the models changed.
"""

from __future__ import annotations

import random
from typing import Final

REGISTRATIONS_PER_BEAT: Final = 100
# At most this long between a worker's registrations: far inside the registry's prune grace
# (60 s), so a live worker's member is never dropped.
REFRESH_MAX_SECONDS: Final = 30.0


class RegistrySchedule:
    def __init__(self, heartbeat_interval: float, rng: random.Random | None = None) -> None:
        self.heartbeat_interval = heartbeat_interval
        self._rng = rng or random.Random()
        self._at = -float("inf")  # the last registration (monotonic seconds)
        self._models: tuple[str, ...] = ()
        self._spread = 0.0  # seconds from the last registration to the next

    def due(self, models: tuple[str, ...], heartbeat_existed: bool, now: float) -> bool:
        """Whether the heartbeat at ``now`` registers the worker."""
        if not heartbeat_existed or models != self._models:
            return True
        # Half a beat early: a registration is due at the heartbeat nearest its time.
        return now - self._at + self.heartbeat_interval / 2 >= self._spread

    def registered(self, models: tuple[str, ...], fleet_size: int, now: float) -> None:
        """A registration at ``now`` found ``fleet_size`` workers in the registry."""
        interval = self.heartbeat_interval
        spread = min(
            interval * max(1.0, fleet_size / REGISTRATIONS_PER_BEAT),
            max(interval, REFRESH_MAX_SECONDS),
        )
        # Workers started together do not register together ever after.
        self._at, self._models = now, models
        self._spread = spread * self._rng.uniform(0.5, 1.0)
