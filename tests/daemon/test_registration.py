"""When a worker registers in the fleet's registry: every heartbeat in a small fleet, less
often in a large one (the fleet as a whole still at least 100 times per heartbeat interval),
and at once when its heartbeat key was gone or its models changed. Steps of a clock, no
sleeping."""

from __future__ import annotations

import itertools
import random

from mlx_redis_worker.daemon.registration import REFRESH_MAX_SECONDS, RegistrySchedule

BEAT = 5.0
MODELS = ("tiny",)


def registrations(schedule: RegistrySchedule, fleet_size: int, beats: int) -> list[int]:
    """The beats (of ``beats``, one every BEAT seconds) at which the worker registers."""
    done = []
    for beat in range(beats):
        now = beat * BEAT
        if schedule.due(MODELS, heartbeat_existed=beat > 0, now=now):
            schedule.registered(MODELS, fleet_size, now)
            done.append(beat)
    return done


def test_a_worker_of_a_small_fleet_registers_with_every_heartbeat() -> None:
    for size in (1, 10, 100):
        schedule = RegistrySchedule(BEAT, random.Random(size))
        assert registrations(schedule, size, 50) == list(range(50))


def test_a_thousand_workers_register_a_hundred_times_per_beat_and_none_waits_past_30_s() -> None:
    rng = random.Random(7)
    fleet = [RegistrySchedule(BEAT, rng) for _ in range(1000)]
    beats = 120  # ten minutes
    per_beat = [0] * beats
    for schedule in fleet:
        done = registrations(schedule, 1000, beats)
        gaps = [(b - a) * BEAT for a, b in itertools.pairwise(done)]
        assert max(gaps) <= REFRESH_MAX_SECONDS
        for beat in done:
            per_beat[beat] += 1
    assert per_beat[0] == 1000  # the start: every heartbeat key was new
    # Past the start, some 220 a beat (30 s apart at most: 4.5 beats on average), never few.
    steady = per_beat[12:]
    assert min(steady) > 50, min(steady)
    assert 100 <= sum(steady) / len(steady) <= 250, sum(steady) / len(steady)


def test_a_lost_heartbeat_or_new_models_register_at_once() -> None:
    schedule = RegistrySchedule(BEAT, random.Random(1))
    schedule.registered(MODELS, 1000, now=0.0)
    assert not schedule.due(MODELS, heartbeat_existed=True, now=BEAT)
    assert schedule.due(MODELS, heartbeat_existed=False, now=BEAT)  # Redis lost it
    assert schedule.due(("tiny", "other"), heartbeat_existed=True, now=BEAT)
