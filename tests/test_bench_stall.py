"""`mlx-worker bench stall`: the streams' gaps and the long prompt's TTFT per prefill bound."""

from __future__ import annotations

import re

from tests.support.processes import mlx_worker


def test_cli_measures_every_bound_and_prints_the_table() -> None:
    args = ["bench", "stall", "--streams", "2", "--long", "300", "--stalls", "inf,1.0"]
    done = mlx_worker(*args, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    number = r"[0-9.]+"
    for bound in (r"inf \(whole chunks\)", r"1\.0"):
        row = rf"^\| 300 \| {bound} \| {number} \| {number} \| {number} \| {number} \| {number} \| "
        # A running stream gets a token in every engine step under either bound.
        assert re.search(row + r"1\.00 \|$", done.stdout, re.M), done.stdout
