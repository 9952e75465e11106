"""`mlx-worker bench models`: both models on one worker against a worker per model, one run."""

from __future__ import annotations

import argparse
import re

from mlx_redis_worker.bench.e2e_bench import Run
from mlx_redis_worker.bench.models_bench import (
    SEPARATE,
    SHARED,
    TOTAL,
    LayoutRun,
    Model,
    Results,
    format_models,
)
from tests.support.processes import mlx_worker

NAMES = ("tiny", "tiny-qwen3")


def _layout(layout: str, a: float, b: float) -> LayoutRun:
    runs = {
        name: Run(name, 4, int(speed), 1.0, [0.1] * 4, [0.5] * 4)
        for name, speed in zip(NAMES, (a, b), strict=True)
    }
    runs[TOTAL] = Run(TOTAL, 8, int(a + b), 1.0, [0.1] * 8, [0.5] * 8)
    return LayoutRun(layout, runs, 2.0, 300 * 2**20)


def test_ratios_are_medians_of_per_rotation_ratios() -> None:
    results = Results([Model(name, name, [], []) for name in NAMES])
    results.by_layout[SHARED] = [_layout(SHARED, a, 100) for a in (90, 50, 99)]
    results.by_layout[SEPARATE] = [_layout(SEPARATE, 100, 100) for _ in range(3)]
    args = argparse.Namespace(concurrency=4, prompt_tokens=32, max_tokens=8, repeat=3)
    out = format_models(results, args)
    assert "shared / separate tok/s, tiny: 0.90" in out
    assert "shared / separate tok/s, tiny-qwen3: 1.00" in out
    assert "shared / separate tok/s, total: 0.95" in out
    assert "| shared | total | 8 | 190.0 | 100 | 500 | 2.0 | 300 |" in out


def test_cli_compares_both_layouts_for_both_models() -> None:
    # A process of its own: the bench starts its own redis-server and worker processes (one
    # serving both models, then one per model).
    args = ["bench", "models", "--concurrency", "2", "--repeat", "1", "--max-tokens", "8"]
    done = mlx_worker(*args, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for layout in (SHARED, SEPARATE):
        for name in (*NAMES, TOTAL):
            jobs = 4 if name == TOTAL else 2
            row = rf"^\| {layout} \| {re.escape(name)} \| {jobs} \| [0-9.]+ \| [0-9]+ \| [0-9]+ \|"
            assert re.search(row, out, re.M), out
        # The workers' CPU seconds and peak RSS: "-" where there is no /proc (macOS).
        cost = r"\| ([0-9.]+|-) \| ([0-9]+|-) \|$"
        assert re.search(rf"^\| {layout} \| {TOTAL} \| .*{cost}", out, re.M), out
    for name in (*NAMES, TOTAL):
        assert re.search(rf"^shared / separate tok/s, {re.escape(name)}: [0-9.]+$", out, re.M)
    assert "Interpretation: " in out
