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
    assert (result.ended_once, result.whole, result.pending_after) == (REQUESTS, REQUESTS, 0)
    assert result.tokens == REQUESTS * TOKENS
    assert result.control_notes["ctl stats"] == f"{WORKERS}/{WORKERS} replies"
    assert result.control_notes["ctl ping"] == f"{WORKERS}/{WORKERS} replies"
    assert result.control_notes["models"] == f"{WORKERS} workers of sim"


def test_the_stand_in_text_is_known_words() -> None:
    assert expected_text(3) == "alpha bravo charlie "
    assert expected_text(9).split()[-1] == "alpha"
