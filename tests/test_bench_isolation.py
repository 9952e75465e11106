"""`mlx-worker bench isolation`: each attacker against the baselines on either side of it."""

from __future__ import annotations

import re
from collections import Counter

from mlx_redis_worker.bench.isolation_bench import Phase, format_isolation
from tests.support.processes import mlx_worker


def _phase(attacker: str, tokens: float, ttft: float, health: float, **got: int) -> Phase:
    cores = {"gateway_cores": 0.25, "worker_cores": 1.5} if attacker else {}
    if attacker:
        cores["attacker_cores"] = 0.125
    rate = 200.0 if attacker else 0.0
    return Phase(
        attacker, tokens, ttft, [health] * 10, Counter(got), **cores, exchanges_per_second=rate
    )


def test_ratios_are_against_the_neighbouring_baselines_and_goals_judged() -> None:
    phases = [
        _phase("", 100, 1.0, 0.01),
        _phase("huge header", 90, 1.5, 0.02, **{"431": 5}),
        _phase("", 80, 1.0, 0.01),
        _phase("read flood", 40, 2.0, 1.5, **{"429": 100, "404": 30}),
        _phase("", 80, 1.0, 0.01),
    ]
    out = format_isolation(phases)
    # 90 against the mean of 100 and 80; 40 against 80.
    # Cores and the attacker's rate as measured; a baseline without CPU figures shows "–".
    assert "| alone (baselines) | 1.00 | 1.00 | 10 | – | – | – | | | |" in out
    assert "| huge header | 1.00 | 1.50 | 20 | 0.25 | – | 1.50 | 0.12 | 200 | 431 ×5 |" in out
    row = "| read flood | 0.50 | 2.00 | 1500 | 0.25 | – | 1.50 | 0.12 | 200 | 429 ×100, 404 ×30 |"
    assert row in out
    assert "victim alone: 80 tok/s" in out
    assert out.rstrip().endswith("NOT met")


def test_cli_runs_every_attacker_and_prints_the_table() -> None:
    # A process of its own: the bench starts its own redis-server, worker and gateway.
    args = ["bench", "isolation", "--concurrency", "2", "--max-tokens", "8", "--idle-sockets", "20"]
    done = mlx_worker(*args, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    attackers = ["huge header", "huge body", "read flood", "resume flood", "hostile schema"]
    attackers += ["nested anyof", "logprobs fanout", "image bomb", "image 50mb", "image flood"]
    for attacker in [*attackers, "20 idle sockets"]:
        row = rf"^\| {attacker} \| [0-9.]+ \| [0-9.]+ \| [0-9]+ \| .*\|$"
        assert re.search(row, done.stdout, re.M), done.stdout
    assert re.search(r"^goals: .*: (met|NOT met)$", done.stdout, re.M), done.stdout
    # The attackers are clients of their own, as on another host (Linux: all of 127/8 is lo).
    assert "connects from an address of its own (127.0.0.2, 127.0.0.3, …)" in done.stdout
