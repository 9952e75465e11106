"""`mlx-worker bench fairness`: three tenants on one worker, fair share against FIFO."""

from __future__ import annotations

import argparse
import re

from mlx_redis_worker.bench.fairness_bench import (
    FAIR,
    FIFO,
    MODES,
    TENANTS,
    ModeRun,
    format_fairness,
)
from tests.support.processes import mlx_worker

ARGS = argparse.Namespace(
    model="tiny",
    slots=2,
    bulk_jobs=4,
    bulk_tokens=16,
    steady_jobs=2,
    steady_tokens=8,
    steady_every=1.0,
    interactive_jobs=2,
    interactive_tokens=4,
    interactive_every=1.0,
    repeat=2,
)


def _run(mode: str, seconds: float, interactive_ttft: float) -> ModeRun:
    return ModeRun(
        mode,
        ttfts={"bulk": [0.1, 0.2], "steady": [0.3], "interactive": [interactive_ttft] * 2},
        tokens={"bulk": 64, "steady": 16, "interactive": 8},
        jobs={"bulk": 4, "steady": 2, "interactive": 2},
        seconds=seconds,
    )


def test_the_ratio_is_the_median_of_per_rotation_ratios() -> None:
    runs = {
        FIFO: [_run(FIFO, 10.0, 5.0), _run(FIFO, 10.0, 5.0)],
        FAIR: [_run(FAIR, 10.0, 0.5), _run(FAIR, 20.0, 0.5)],
    }
    out = format_fairness(runs, ARGS)
    assert "total tok/s, fair share / FIFO: 0.75 (misses the goal >= 0.95)" in out
    assert "| fair share | interactive | 2 | 500 | 500 | 8 |" in out
    assert "| FIFO | interactive | 2 | 5000 | 5000 | 8 |" in out


def test_cli_runs_both_modes_for_every_tenant() -> None:
    # A process of its own: the bench starts its own redis-server and worker processes.
    args = ["bench", "fairness", "--bulk-jobs", "4", "--bulk-tokens", "12", "--steady-jobs", "2"]
    args += ["--interactive-jobs", "2", "--steady-every", "1", "--interactive-every", "1"]
    done = mlx_worker(*args, "--repeat", "1", timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for mode in MODES:
        for tenant in TENANTS:
            row = rf"^\| {re.escape(mode)} \| {tenant} \| [0-9]+ \| ([0-9]+|-) \| ([0-9]+|-) \| "
            assert re.search(row + r"[0-9]+ \|$", out, re.M), out
        assert re.search(rf"^\| {re.escape(mode)} \| \*\*total tok/s\*\* \|", out, re.M), out
    assert re.search(r"^total tok/s, fair share / FIFO: [0-9.]+ \((meets|misses)", out, re.M)
