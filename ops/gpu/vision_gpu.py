"""Image requests on an NVIDIA GPU (MLX's CUDA backend): ``mlx-worker bench vision`` on a
random-weight model of SmolVLM2-2.2B's shape (``tiny-vision --size 2b``: SigLIP-so400m at 384
pixels, scale factor 3, SmolLM2-1.7B's text model), bf16.

The fixture is built here first (random weights drawn on the device, a tokenizer trained on
the host: a minute or two), then the bench's three paths run in rotation: mlx-vlm's
``stream_generate`` one request after another, mlx-vlm's ``BatchGenerator`` driven directly,
and our engine. Each picture is resized to a longest edge of 1536 and tiled: a 1024x768
picture is 4 x 3 tiles and the whole one, 13 x 81 = 1,053 image tokens, a document page's
worth. Run by ops/gpu/run.sh with ``GPU_BENCH=vision_gpu``; prints the bench's tables and
writes its lines to ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path

from mlx_redis_worker.bench.vision_bench import run_vision_bench
from mlx_redis_worker.models.tiny_vision import prepare_tiny_vision


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", required=True, help="where the printed report goes too")
    parser.add_argument("--size", default="2b", choices=["2b", "small"])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--image-size", default="1024x768")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache-dir", default="/tmp/mlxw-models")
    args = parser.parse_args()
    started = time.perf_counter()
    folder = prepare_tiny_vision(args.size, cache_dir=args.cache_dir, dtype="bfloat16")
    print(f"fixture {folder} ready in {time.perf_counter() - started:.0f} s", flush=True)
    bench = argparse.Namespace(
        model=str(folder),
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        image_size=args.image_size,
        repeat=args.repeat,
    )
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = run_vision_bench(bench)
    print(report.getvalue(), flush=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "report": report.getvalue()}))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
