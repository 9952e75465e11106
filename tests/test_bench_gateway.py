"""`mlx-worker bench gateway`: the OpenAI gateway against the protocol client, one run."""

from __future__ import annotations

import argparse
import re

from mlx_redis_worker.bench.e2e_bench import Run
from mlx_redis_worker.bench.gateway_bench import DIRECT, GATEWAY, Measured, Results, format_gateway
from tests.support.processes import mlx_worker


def _measured(path: str, tokens: int, ttft_ms: float, outside_ms: float) -> Measured:
    run = Run(path, 4, tokens, 1.0, [ttft_ms / 1e3] * 4, [0.5] * 4)
    cpu = {"worker": 1.0, "Redis": 0.2, "gateway": None, "client": 0.1}
    return Measured(run, [outside_ms / 1e3] * 4, cpu)


def test_ratios_and_goals_are_medians_of_per_rotation_values() -> None:
    results = Results()
    results.by_path[DIRECT] = [_measured(DIRECT, 100, 100, 20) for _ in range(3)]
    results.by_path[GATEWAY] = [
        _measured(GATEWAY, tokens, ttft, outside)
        for tokens, ttft, outside in ((90, 130, 25), (96, 105, 32), (99, 101, 40))
    ]
    args = argparse.Namespace(model="tiny", concurrency=4, prompt_tokens=32, max_tokens=8, repeat=3)
    out = format_gateway(results, args)
    assert "gateway / direct tok/s = 0.960, goal ≥ 0.95 (met; per rotation 0.900, " in out
    assert "gateway - direct TTFT p50 = +5.0 ms, goal ≤ +10 ms (met; " in out
    assert "outside the worker (submit, delivery) = +12.0 ms, goal ≤ +10 ms (MISSED; " in out
    assert "| direct (protocol client) | 4 | 100 | 100.0 | 100.0 / 100.0 | 20.0 | 500 " in out
    assert out.splitlines()[3].endswith("| 1.00 | 0.20 | - | 0.10 |")  # unknown CPU: "-"


def test_cli_runs_both_paths_and_prints_the_table() -> None:
    # A process of its own: the bench starts its own redis-server, worker and gateway.
    args = ["bench", "gateway", "--concurrency", "2", "--repeat", "1", "--max-tokens", "8"]
    done = mlx_worker(*args, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    number = r" -?[0-9.]+ \|"
    for path in (DIRECT, GATEWAY):
        head = rf"^\| {re.escape(path)} \| 2 \| [0-9]+ \| [0-9.]+ \| [0-9.]+ / [0-9.]+ \|"
        assert re.search(rf"{head}({number}){{2}}( [0-9.]+ \|| - \|){{4}}$", out, re.M), out
    assert re.search(r"^gateway / direct tok/s = [0-9.]+, goal ≥ 0\.95 \((met|MISSED);", out, re.M)
    assert re.search(r"^gateway - direct TTFT p50 = [-+][0-9.]+ ms, goal", out, re.M), out
    assert re.search(r"^  outside the worker \(submit, delivery\) = [-+][0-9.]+ ms", out, re.M)
