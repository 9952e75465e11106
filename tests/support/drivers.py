"""What the reliability drivers (``python -m tests.reliability.X``) share: their result and
its figures table, their work directory, and the command-line tail (``--dir``, the report,
the exit status)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# Problems printed at the end of a run; the rest are counted.
SHOWN_PROBLEMS = 50

Config = TypeVar("Config", bound="DataclassInstance")


@dataclass
class DriverResult:
    """A driver's run: the figures README's "Reliability" section quotes, what went wrong, and
    the raw values the tests assert on."""

    title: str
    figures: list[tuple[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        return format_table(self.title, self.figures)


def format_table(title: str, rows: Sequence[tuple[str, Any]]) -> str:
    """A two-column markdown table (so the CLI output pastes into the README)."""
    lines = [f"### {title}", "", "| figure | value |", "|---|---|"]
    for name, value in rows:
        if isinstance(value, float):
            value = f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
        lines.append(f"| {name} | {value} |")
    return "\n".join(lines)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def work_directory(given: Path | None, name: str) -> Path:
    """``given`` (created when missing), or a fresh temporary ``mlxw-NAME-*`` folder: where
    the run keeps its Redis data and the workers' logs."""
    directory = Path(given or tempfile.mkdtemp(prefix=f"mlxw-{name}-"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def driver_arguments(doc: str) -> argparse.ArgumentParser:
    """A driver's command line, described by its docstring's first paragraph, with the option
    every driver takes: ``--dir``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="keep logs here")
    return parser


def config_from_arguments(
    defaults: Config, doc: str, options: Sequence[str], argv: Sequence[str] | None
) -> Config:
    """``defaults`` (a driver's config dataclass) with what the command line changes: one
    option per field in ``options`` (``--max-tokens`` for ``max_tokens``, of its default's
    type; ``--no-NAME`` for a field that is True by default), and ``--dir``."""
    parser = driver_arguments(doc)
    for name in options:
        default = getattr(defaults, name)
        flag = name.replace("_", "-")
        if isinstance(default, bool):
            action = "store_false" if default else "store_true"
            parser.add_argument(
                f"--no-{flag}" if default else f"--{flag}", dest=name, action=action
            )
        else:
            parser.add_argument(f"--{flag}", type=type(default), default=default)
    args = parser.parse_args(argv)
    changed = {name: getattr(args, name) for name in options}
    return dataclasses.replace(defaults, directory=args.dir, **changed)


def report(result: DriverResult, config: Any) -> int:
    """Print the figures table, the config, where the logs are and the problems; the exit
    status (1 when there are problems)."""
    print(result.table())
    shown = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    print(f"\nconfig: {shown}\nlogs: {result.values.get('directory')}")
    for problem in result.problems[:SHOWN_PROBLEMS]:
        print("PROBLEM:", problem)
    if len(result.problems) > SHOWN_PROBLEMS:
        print(f"... and {len(result.problems) - SHOWN_PROBLEMS} more problems")
    return 1 if result.problems else 0


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Run a driver's ``main`` and end the process with its status, without running C++
    static destructors: right after an engine closed, MLX's exit can race its own threads and
    abort (rc 134) though all went well."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
