"""`mlx-worker bench fleet`'s small configuration: 50 simulated workers (the real daemon over the
engine stand-in) on one Redis server and on a local 3-master Cluster. Counts, not seconds:
every request ends exactly once, every stream is whole (seq gapless, one terminal event, the
stand-in's known words), and every worker answers the control plane."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_redis_worker.bench.fleet_bench import FleetLoad, measure_fleet
from mlx_redis_worker.bench.fleet_spec import expected_text

WORKERS = 50
REQUESTS = 150
TOKENS = 12


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("kind", "masters"), [("server", 0), ("cluster", 3)])
def test_fifty_simulated_workers_end_every_request_once_with_whole_streams(
    kind: str, masters: int, tmp_path: Path
) -> None:
    load = FleetLoad(
        workers=WORKERS,
        hosts=2,
        max_concurrency=4,
        step_ms=20,
        requests=REQUESTS,
        max_tokens=TOKENS,
        rate=0,  # all at once: 150 requests over 200 slots, then the fleet drains
        idle_seconds=1,
        gateway=False,
    )
    result = measure_fleet(kind, masters, load, tmp_path)
    assert result.problems == ()
    (phase,) = result.phases
    seen = phase.summary
    assert (seen.submitted, seen.ended_once, seen.whole) == (REQUESTS, REQUESTS, REQUESTS)
    assert (seen.duplicates, seen.lost, result.pending_after) == (0, 0, 0)
    assert seen.tokens == REQUESTS * TOKENS
    assert result.control_notes["ctl stats"].startswith(f"{WORKERS}/{WORKERS} replies; CPU")
    assert result.control_notes["ctl ping"].startswith(f"{WORKERS}/{WORKERS} replies; CPU")
    assert result.control_notes["models"] == f"{WORKERS} workers of sim"


@pytest.mark.timeout(300)
def test_a_timed_load_and_a_reclaim_sweep_count_every_request_and_orphan(tmp_path: Path) -> None:
    load = FleetLoad(
        workers=10,
        hosts=1,
        max_concurrency=4,
        step_ms=20,
        max_tokens=TOKENS,
        rate=20,
        duration=2,  # some 40 requests, however long they take to end
        idle_seconds=0.5,
        gateway=False,
        reclaim_pending=300,
    )
    result = measure_fleet("server", 0, load, tmp_path)
    assert result.problems == ()
    seen = result.phases[0].summary
    assert 30 <= seen.submitted <= 41
    assert (seen.ended_once, seen.whole, seen.duplicates, seen.lost) == (
        seen.submitted,
        seen.submitted,
        0,
        0,
    )
    assert seen.tokens == seen.submitted * TOKENS
    assert result.pending_after == 0
    sweep = result.reclaim
    assert sweep is not None
    # A lane's pass takes at most its max_concurrency; the cursor visits all 300.
    assert (sweep.pending, sweep.first_taken, sweep.taken) == (300, 4, 300)
    assert sweep.passes == 300 // 4


def test_the_stand_in_text_is_known_words() -> None:
    assert expected_text(3) == "alpha bravo charlie "
    assert expected_text(9).split()[-1] == "alpha"
