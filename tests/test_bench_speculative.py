"""`mlx-worker bench speculative` at tiny scale: it runs both paths, compares their outputs and
ends with its one-line verdict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mlx_redis_protocol.cli import build_parser


def test_bench_runs_at_tiny_scale_and_ends_with_its_verdict(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = (
        f"bench speculative --model {tiny_model_path} --prompts 2 --max-tokens 16 --repeat 1 "
        "--batch 4 --batch-max-tokens 8"
    )
    args = build_parser().parse_args(command.split())
    assert args.func(args) == 0  # 0: the greedy outputs were equal
    # The bench's own lines (the engine's log lines go to the same stream).
    lines = [line for line in capsys.readouterr().out.splitlines() if "engine_" not in line]
    (batch,) = [line for line in lines if line.startswith("batch 4:")]
    assert re.fullmatch(r"batch 4: plain [\d.]+ tok/s, speculative [\d.]+ tok/s, ratio .*", batch)
    assert re.fullmatch(
        r"speculative speedup at B=1: \d+\.\d\d \(greedy outputs equal: yes\)", lines[-1]
    )
    assert sum(line.startswith("  prompt ") and "outputs equal" in line for line in lines) == 2


def test_bench_with_a_draft_model_at_tiny_scale(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model drafting for itself: outputs equal, every draft accepted."""
    command = (
        f"bench speculative --model {tiny_model_path} --method draft_model --draft-model "
        f"{tiny_model_path} --prompts 2 --max-tokens 16 --repeat 1 --batch 0"
    )
    args = build_parser().parse_args(command.split())
    assert args.func(args) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "engine_" not in line]
    assert f"(draft model {tiny_model_path})" in lines[0]
    assert not any(line.startswith("batch 0") for line in lines)  # batch 0: batch 1 only
    (stats,) = [line for line in lines if line.startswith("  speculation:")]
    assert "acceptance 1.00" in stats
    assert re.fullmatch(
        r"speculative speedup at B=1: \d+\.\d\d \(greedy outputs equal: yes\)", lines[-1]
    )
