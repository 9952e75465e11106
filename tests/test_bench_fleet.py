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
    # Where the load's CPU went: each node, then the hosts, the generator and the bench.
    assert len(phase.node_cpu_seconds) == max(masters, 1)
    assert set(phase.process_cpu_seconds) == {"hosts", "clients", "bench"}
    assert phase.process_cpu_seconds["hosts"] > 0 and phase.process_cpu_seconds["clients"] > 0
    # Redis' commands over the load: a request's job entry, then its log's entries (the
    # queued marker, at least one delta and the done, at most a delta a token), each also
    # published once; the publishing script runs once a worker's step on one server, once a
    # step per node on a Cluster.
    calls = phase.commands
    logged = calls["xadd"] - REQUESTS
    assert 3 * REQUESTS <= logged <= REQUESTS * (TOKENS + 2)
    published = calls["spublish" if kind == "cluster" else "publish"]
    assert published == logged
    if kind == "cluster":
        assert result.stream_node in range(masters)
        # Fewer script calls than events: a worker's step sends one publishing call per
        # node, carrying its requests of every slot there (one per request a step before).
        assert calls["evalsha"] < published
    else:
        assert result.stream_node is None


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
        clients=2,  # two load processes, started together once both are connected
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
    assert result.phases[0].summary.cpu_seconds > 0  # the two processes' own CPU
    sweep = result.reclaim
    assert sweep is not None
    # A lane's pass takes at most its max_concurrency; the cursor visits all 300.
    assert (sweep.pending, sweep.first_taken, sweep.taken) == (300, 4, 300)
    assert sweep.passes == 300 // 4


def test_the_stand_in_text_is_known_words() -> None:
    assert expected_text(3) == "alpha bravo charlie "
    assert expected_text(9).split()[-1] == "alpha"
