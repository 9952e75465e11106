"""`mlx-worker bench tools` at tiny scale: the tiny model's weights are random, but every
call it makes under the tool grammar parses and validates, and the report says so."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlx_redis_protocol.cli import build_parser
from mlx_redis_worker.bench.schema_suite import build_suite, llguidance_accepts
from mlx_redis_worker.bench.tools_bench import (
    PassResult,
    call_error,
    format_report,
    function_of,
    job_of,
    suite_slice,
)


@pytest.mark.timeout(600)
def test_bench_runs_at_tiny_scale_and_every_call_validates(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = "bench tools --model tiny --schemas 3 --slice 1: --batch 2 --max-tokens 96"
    args = build_parser().parse_args(command.split())
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "schemas 1..2 of a suite of 3" in out and "one call an answer" in out
    assert "required        2" in out and "auto            2" in out
    assert "every call valid: yes" in out


def test_a_call_that_does_not_validate_fails_the_report() -> None:
    item = build_suite(1, llguidance_accepts).schemas[0]
    name = function_of(item).name
    assert call_error(item, name, "{").startswith("arguments not JSON")
    assert call_error(item, "other", "{}") == "called 'other'"
    bad = PassResult("required", answers=1, with_calls=1, calls=1, invalid=["schema 0: x"])
    report, ok = format_report([bad])
    assert not ok and "INVALID (required) schema 0: x" in report


def test_a_slice_is_part_of_the_suite_and_an_answer_holds_one_call_unless_parallel() -> None:
    items = build_suite(5, llguidance_accepts).schemas
    assert [item.index for item in suite_slice(items, "1:3")] == [1, 2]
    assert [item.index for item in suite_slice(items, "3:")] == [3, 4]
    assert suite_slice(items, None) == items
    assert job_of(items[0], "required").parallel_tool_calls is False
    assert job_of(items[0], "required", parallel=True).parallel_tool_calls is True
