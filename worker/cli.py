"""The ``mlx-worker`` command: a thin front that hands each subcommand to its layer."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import worker  # noqa: F401  (loads OpenBLAS before anything imports mlx)
from worker.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-worker", description=__doc__)
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        default=os.environ.get("MLXW_LOG_FORMAT", "console"),
        help="log lines as JSON (production) or for humans (env MLXW_LOG_FORMAT)",
    )
    parser.add_argument(
        "--log-level", default=os.environ.get("MLXW_LOG_LEVEL", "INFO"), help="env MLXW_LOG_LEVEL"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="prepare offline model fixtures")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser("prepare", help="build an mlx-lm model folder")
    prepare.add_argument("name", choices=["smollm2", "tiny"])
    prepare.add_argument("--dtype", choices=["float32", "bfloat16", "q4"], default="float32")
    prepare.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    prepare.add_argument("--size", choices=["small", "medium"], default="small")
    prepare.add_argument(
        "--cache-dir", default=None, help="default: ~/.cache/mlx-redis-worker/models"
    )
    prepare.add_argument("--force", action="store_true", help="rebuild even when present")

    bench = commands.add_parser("bench", help="benchmarks with same-run baselines")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    engine = bench_commands.add_parser("engine", help="engine vs mlx-lm, same load")
    engine.add_argument("--model", default="tiny", help="tiny | smollm2 | a path or hub id")
    engine.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    engine.add_argument("--prompt-tokens", type=int, default=32)
    engine.add_argument("--max-tokens", type=int, default=64)
    engine.add_argument(
        "--sequential-max",
        type=int,
        default=32,
        help="skip the sequential baseline above this concurrency",
    )
    engine.add_argument("--skip", default="", help="paths to skip: sequential,batch,sync,async")
    engine.add_argument("--repeat", type=int, default=3, help="rotations of all paths per level")

    demo = commands.add_parser("demo", help="stream a few concurrent generations")
    demo.add_argument("--model", default="smollm2", help="smollm2 | tiny | a path or hub id")
    demo.add_argument("--max-tokens", type=int, default=48)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    if args.command == "model":
        from worker.models.prepare import run_prepare

        return run_prepare(args)
    if args.command == "bench":
        from worker.bench.engine_bench import run_bench

        return run_bench(args)
    if args.command == "demo":
        from worker.demo import run_demo

        return run_demo(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
