"""Memory soak, short profile: 300 requests (the long profile, 2,000, is ``make chaos``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.soak import SoakConfig, run_soak


@pytest.mark.timeout(240)
def test_memory_settles_after_warm_up_and_no_request_state_is_left(tmp_path: Path) -> None:
    """After a warm-up of 150 requests (the 64-entry prefix cache is full by then) the
    worker's RSS and MLX active memory stay flat; nothing of any request is left in the
    worker at the end. The 2,000-request run holds growth under 5 %; a 150-request window
    sees the allocator's swings and steps, so these bounds are looser."""
    result = run_soak(SoakConfig(requests=300, min_warm_up=150, directory=tmp_path))
    print(result.table())
    assert result.problems == [], result.problems
    # RSS moves in allocator steps and swings of up to ~10 % in this short window (tenths of
    # one run: 376 361 400 372 365 398 MiB; a step 371 -> 409 then flat in another): measured
    # from the single reading after warm-up, the same code read +0.5 % and +16 %. This bound
    # catches a gross leak (about 600 KB a request); MLX's own memory (below) and the state
    # left per request (problems) are the fine checks, and the 2,000-request run's RSS < 5 %.
    assert result.values["rss_growth"] < 0.25, result.values
    assert result.values["active_growth"] < 0.10, result.values
