"""`mlx-worker bench e2e --cluster`: one run measures the single node and the Cluster."""

from __future__ import annotations

import argparse
import re

from mlx_redis_worker.bench.e2e_bench import CLUSTER, SINGLE, Level, Run, format_e2e
from tests.support.processes import mlx_worker


def _run(path: str, tokens_per_second: float, per_step: float | None = None) -> Run:
    return Run(path, 4, int(tokens_per_second), 1.0, [0.1] * 4, [0.5] * 4, per_step)


def test_the_cluster_ratio_is_the_median_of_per_rotation_ratios() -> None:
    single = [_run("single", s, 1.0) for s in (100, 100, 100)]
    cluster = [_run("cluster", c, 2.0) for c in (95, 80, 99)]
    level = Level(4, {SINGLE: single, CLUSTER: cluster}, [_run("engine", 100)] * 3, [])
    level.raw = [_run("raw", 100)] * 3
    args = argparse.Namespace(model="tiny", prompt_tokens=32, max_tokens=8, repeat=3)
    out = format_e2e([level], args)
    assert "cluster / single = 0.95 (goal ≥ 0.90: met" in out
    # Each topology against raw BatchGenerator, the issue-28 goal: 95/100, 80/100, 99/100.
    assert "end-to-end / raw BatchGenerator tok/s = 0.950 (goal ≥ 0.95: met)" in out
    level.e2e[CLUSTER] = [_run("cluster", c) for c in (85, 80, 99)]
    out = format_e2e([level], args)
    assert "cluster / single = 0.85 (goal ≥ 0.90: MISSED" in out
    assert "end-to-end / raw BatchGenerator tok/s = 0.850 (goal ≥ 0.95: MISSED)" in out


def test_cli_measures_both_topologies() -> None:
    # A process of its own: the CLI configures logging for the whole process, and the bench
    # starts a worker process per topology (its own Redis: no MLXW_REDIS_URL is passed on).
    args = ["bench", "e2e", "--model", "tiny", "--concurrency", "2", "--repeat", "1"]
    done = mlx_worker(*args, "--max-tokens", "8", "--cluster")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout

    def per_step(path: str) -> float:
        row = re.search(rf"^\| 2 \| end to end, {re.escape(path)} \|.*\| ([0-9.]+) \|$", out, re.M)
        assert row, out
        return float(row.group(1))

    assert per_step(SINGLE) == 1.0
    # One pipelined batch of per-slot script calls counts as one round trip per step.
    assert per_step(CLUSTER) >= 1.0
    assert f"  {SINGLE}: end-to-end / engine alone tok/s = " in out
    assert f"  {CLUSTER}: end-to-end / engine alone tok/s = " in out
    assert re.search(r"^  raw, CPU µs per delivered token: raw BatchGenerator [0-9]+$", out, re.M)
    assert re.search(r"^  cluster / single = [0-9.]+ \(goal ≥ 0\.90: (met|MISSED)", out, re.M), out
