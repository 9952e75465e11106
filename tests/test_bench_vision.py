"""`mlx-worker bench vision` at tiny scale: the three paths run on the same pictures and
generate the same number of tokens, and the report ends with its ratios."""

from __future__ import annotations

import re

import pytest

from mlx_redis_protocol.cli import build_parser


def test_bench_runs_its_three_paths_on_the_same_work(capsys: pytest.CaptureFixture[str]) -> None:
    command = "bench vision --model tiny-vision --concurrency 2 --max-tokens 6 --repeat 1"
    args = build_parser().parse_args(command.split())
    assert args.func(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "engine_" not in line]
    table = [line for line in lines if line.startswith("| ") and "tok/s" not in line]
    rows = [line.split("|")[1:-1] for line in table]
    paths = [row[0].strip() for row in rows]
    assert paths == [
        "mlx-vlm stream_generate (one after another)",
        "mlx-vlm BatchGenerator",
        "engine add_request + stream_outputs",
    ]
    assert len({row[1].strip() for row in rows}) == 1  # the same tokens on every path
    assert int(rows[0][1]) == 2 * 6
    ratios = [line for line in lines if line.startswith("  engine / ")]
    assert len(ratios) == 5 and all(re.search(r"= \d+\.\d\d", line) for line in ratios)
