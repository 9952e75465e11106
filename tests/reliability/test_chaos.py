"""The chaos run's short profile: 100 jobs, 3 workers, a SIGKILL every ~3 s, one Redis
restart (AOF). The long profile is ``make chaos``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.chaos import ChaosConfig, run_chaos


@pytest.mark.timeout(240)
def test_chaos_short_profile(tmp_path: Path) -> None:
    """Every valid job ends with exactly one done whose greedy text equals a direct engine
    run (or is dead-lettered with a reason); every invalid entry is dead-lettered with the
    decoder's code; no job is lost or delivered twice; every log holds gapless seqs with a
    reset exactly at each new attempt; every subscriber's merged stream equals its log."""
    config = ChaosConfig(
        jobs=100,
        workers=3,
        producers=3,
        max_tokens=12,
        kill_every=3.0,
        rate=10.0,
        directory=tmp_path,
    )
    result = run_chaos(config)
    print(result.table())
    assert result.problems == [], result.problems[:20]
    values = result.values
    assert values["lost"] == 0
    assert values["duplicates"] == 0
    assert values["mismatches"] == 0
    assert values["done"] + values["valid_dead"] == config.jobs
    assert values["kills"] >= 2, "the killer must have struck during the run"
    assert values["redis_downtime"] is not None
