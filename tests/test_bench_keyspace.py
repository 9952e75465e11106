"""`mlx-worker bench keyspace`: the request path with unrelated keys in Redis and without."""

from __future__ import annotations

import argparse
import re

from mlx_redis_worker.bench.keyspace_bench import (
    EMPTY,
    FILLED,
    FIRST_TOKEN,
    MEASURES,
    SCAN_READ,
    STATS,
    Samples,
    format_keyspace,
)
from tests.support.processes import mlx_worker


def test_ratios_are_of_the_medians_and_the_goal_is_judged() -> None:
    results = Samples()
    for measure, empty, filled in (
        (STATS, [0.001, 0.002, 0.009], [0.0021, 0.0021, 0.002]),
        (FIRST_TOKEN, [0.1, 0.1, 0.1], [0.11, 0.5, 0.11]),
        (SCAN_READ, [0.001] * 3, [0.04] * 3),
    ):
        for server, seconds in ((EMPTY, empty), (FILLED, filled)):
            for value in seconds:
                results.add(measure, server, value)
    args = argparse.Namespace(repeat=1, samples=3)
    out = format_keyspace(results, {EMPTY: 20, FILLED: 1_000_020}, args)
    assert "keys: 20 (empty), 1,000,020 (filled)" in out
    rows = {line[:28].strip(): line.split() for line in out.splitlines()[2:5]}
    assert rows[STATS][-1] == "1.05x"
    assert rows[FIRST_TOKEN][-1] == "1.10x"
    assert rows[SCAN_READ][-1] == "40.00x"
    assert out.splitlines()[-1] == (
        f"goal (issue 25): {STATS} within 1.2x; {FIRST_TOKEN} within 1.2x"
    )


def test_cli_measures_both_servers() -> None:
    # A process of its own: the bench starts two redis-servers and a worker on each.
    args = ["bench", "keyspace", "--keys", "5000", "--samples", "2", "--repeat", "1"]
    done = mlx_worker(*args, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert re.search(r"keys: \d+ \(empty\), 5,0\d\d \(filled\)", out), out
    for measure in MEASURES:
        number = r"[0-9.]+/[0-9.]+"
        row = rf"^{re.escape(measure)} +{number} +{number} +[0-9.]+x$"
        assert re.search(row, out, re.M), out
    assert re.search(r"^goal \(issue 25\): ", out, re.M), out
