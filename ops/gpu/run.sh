#!/usr/bin/env bash
# Second half of the GPU run (see ops/gpu/README.md): join the mlx-cuda-13 wheel carried in two
# parts, install MLX next to the image's nvidia-* packages, and run the benchmark.
set -euo pipefail
cd "$(dirname "$0")/../.."
cat /root/mlx-cuda-part-aa .whl/mlx-cuda-part-ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
# Every wheel carried in .whl: MLX, mlx-lm, and what the engine's packages import beyond the
# image's own (structlog, msgpack, redis, xxhash, hiredis; llguidance for structured_gpu.py).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .whl/*.whl
# The three import packages, from their folders (protocol/, worker/, worker/gateway/).
export PYTHONPATH="$PWD/worker:$PWD/protocol:$PWD/worker/gateway" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bench="${GPU_BENCH:-gpu_bench}"
python3 "ops/gpu/$bench.py" --json "${OUT:-/tmp}/$bench.json" "$@" 2>&1 | tee "${OUT:-/tmp}/$bench.log"
