"""The ``mlx-worker`` command: a thin front that hands each subcommand to its layer."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import worker  # noqa: F401  (loads OpenBLAS before anything imports mlx)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-worker", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="prepare offline model fixtures")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser("prepare", help="build an mlx-lm model folder")
    prepare.add_argument("name", choices=["smollm2", "tiny"])
    prepare.add_argument("--dtype", choices=["float32", "bfloat16", "q4"], default="float32")
    prepare.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    prepare.add_argument("--size", choices=["small", "medium"], default="small")
    prepare.add_argument("--cache-dir", default=None, help="default: ~/.cache/mlx-redis-worker/models")
    prepare.add_argument("--force", action="store_true", help="rebuild even when present")

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "model":
        from worker.models.prepare import run_prepare

        return run_prepare(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
