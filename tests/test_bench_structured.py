"""`mlx-worker bench structured`: the schema suite, and the bench at tiny scale.

The tiny model's weights are random: its text is gibberish, but constrained decoding still
makes every output that ends by ``stop`` match its schema.
"""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest

from mlx_redis_protocol.cli import build_parser
from mlx_redis_worker.bench.schema_suite import (
    MAX_INSTANCE_CHARS,
    build_suite,
    instance_chars,
    llguidance_accepts,
)
from mlx_redis_worker.bench.structured_bench import percentile
from mlx_redis_worker.engine.config import GrammarLimits


def test_suite_is_deterministic_varied_and_bounded() -> None:
    suite = build_suite(200, llguidance_accepts)
    assert [s.schema for s in suite.schemas] == [
        s.schema for s in build_suite(200, llguidance_accepts).schemas
    ]
    text = " ".join(str(s.schema) for s in suite.schemas)
    for keyword in ("'anyOf'", "'enum'", "'minItems'", "'maximum'", "'number'", "'boolean'"):
        assert keyword in text
    for item in suite.schemas:
        jsonschema.Draft202012Validator.check_schema(item.schema)
        assert item.schema["additionalProperties"] is False
        assert instance_chars(item.schema) <= MAX_INSTANCE_CHARS
        assert item.description.startswith("Describe a ") and "\n" not in item.description


def test_suite_drops_and_counts_what_the_grammar_engine_refuses() -> None:
    suite = build_suite(10, lambda schema: len(schema["properties"]) != 2)
    assert len(suite.schemas) == 10 and suite.refused > 0
    assert all(len(s.schema["properties"]) != 2 for s in suite.schemas)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 201)]
    assert percentile(values, 0.5) == 100.0
    assert percentile(values, 0.99) == 198.0
    assert percentile([3.0], 0.99) == 3.0


@pytest.mark.timeout(60)
def test_bench_runs_at_tiny_scale_and_prints_its_tables(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = "bench structured --model tiny --schemas 4 --batch 2 --max-tokens 12 --repeat 1"
    args = build_parser().parse_args(command.split())
    assert args.func(args) == 0
    out = capsys.readouterr().out
    # finished | stop | valid | invalid 0 | cut | cut flagged | other 0 | agrees 4/4
    row = r"^\| 4 \| (\d) \| (\d) \| 0 \| (\d) \| (\d) \| 0 \| 4/4 \|"
    found = re.search(row, out, re.M)
    assert found, out
    stop, valid, cut, flagged = map(int, found.groups())
    assert stop == valid and cut == flagged and stop + cut == 4
    assert re.search(r"^\| 4 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| 4/4 \| 0 \|$", out, re.M), out
    for path in ("unconstrained", "constrained"):
        assert re.search(rf"^\| {path} \| 1 \| \d+ \| \d+ \| [0-9.]+ \(", out, re.M), out
    assert "constrained / unconstrained decode tok/s = " in out
    assert "correctness checks: all held" in out


@pytest.mark.timeout(300)
def test_hostile_bench_runs_at_tiny_scale_and_prints_its_ratios(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rotation of every mode; under a 4 KiB schema limit every hostile request is refused
    by size, before it compiles, and counted as such."""
    command = (
        "bench structured --hostile --model tiny --kind long_enum --repeat 1 --max-tokens 8 "
        "--fresh 2 --head-start 0.2 --max-schema-bytes 4096"
    )
    args = build_parser().parse_args(command.split())
    assert args.func(args) == 0
    out = capsys.readouterr().out
    compile_ms = GrammarLimits().max_grammar_compile_ms  # the worker's default, not a flag
    assert f"limits: max_schema_bytes 4096, max_grammar_compile_ms {compile_ms}," in out
    for mode in ("plain", "fresh", "cached"):
        assert re.search(rf"^{mode} +[0-9.]+ \([0-9.]+\.\.[0-9.]+\) +\d+, \d+, ", out, re.M), out
    fresh = re.search(r"^fresh .* (\d+), (\d+), \{'max_schema_bytes': (\d+)\}$", out, re.M)
    assert fresh, out
    started, finished, refused = map(int, fresh.groups())
    assert finished == 0 and refused >= 1 and started >= refused
    assert "matchers built 0" in out  # nothing over the limit was compiled
