"""``mlx-worker model prepare {smollm2|smollm2-draft|tiny|tiny-vision|tiny-embed|minilm}``: build
a fixture folder and print its path."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mlx_redis_worker.models.fixture_packages import MissingFixturePackage

EXIT_MISSING_PACKAGE = 2


def run_prepare(args: argparse.Namespace) -> int:
    """Dispatch the parsed CLI arguments; return the process exit code."""
    started = time.monotonic()
    try:
        folder = _prepare(args)
    except MissingFixturePackage as exc:
        print(f"mlx-worker: {exc}", file=sys.stderr)
        return EXIT_MISSING_PACKAGE
    print(f"prepared in {time.monotonic() - started:.1f}s", file=sys.stderr)
    print(folder)
    return 0


def _prepare(args: argparse.Namespace) -> Path:
    if args.name == "smollm2":
        from mlx_redis_worker.models.smollm2 import prepare_smollm2

        return prepare_smollm2(dtype=args.dtype, cache_dir=args.cache_dir, force=args.force)
    if args.name == "smollm2-draft":
        from mlx_redis_worker.models.draft import SMOLLM2_DRAFT_LAYERS, prepare_smollm2_draft

        layers = args.layers if args.layers is not None else SMOLLM2_DRAFT_LAYERS
        return prepare_smollm2_draft(layers=layers, cache_dir=args.cache_dir, force=args.force)
    if args.name == "tiny":
        from mlx_redis_worker.models.tiny import prepare_tiny

        return prepare_tiny(
            arch=args.arch, size=args.size, cache_dir=args.cache_dir, force=args.force
        )
    if args.name == "tiny-vision":
        from mlx_redis_worker.models.tiny_vision import VISION_SIZES, prepare_tiny_vision

        if args.size not in VISION_SIZES:
            raise ValueError(f"tiny-vision comes in sizes {VISION_SIZES}, not {args.size!r}")
        if args.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"tiny-vision comes in float32 or bfloat16, not {args.dtype!r}")
        return prepare_tiny_vision(
            size=args.size, cache_dir=args.cache_dir, force=args.force, dtype=args.dtype
        )
    if args.name == "tiny-embed":
        from mlx_redis_worker.models.encoders import prepare_tiny_encoder

        return prepare_tiny_encoder(cache_dir=args.cache_dir, force=args.force)
    if args.name == "minilm":
        from mlx_redis_worker.models.encoders import prepare_minilm

        return prepare_minilm(cache_dir=args.cache_dir, force=args.force)
    raise ValueError(f"unknown model fixture {args.name!r}")
