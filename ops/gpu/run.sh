#!/usr/bin/env bash
# Second half of the GPU run (see ops/gpu/README.md): join the mlx-cuda-13 wheel carried in two
# parts, install MLX next to the image's nvidia-* packages, and run the benchmark.
set -euo pipefail
cd "$(dirname "$0")/../.."
cat /root/mlx-cuda-part-aa .whl/mlx-cuda-part-ab > /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
# llguidance only for structured_gpu.py (GPU_BENCH=structured_gpu).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    /tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl .whl/mlx-0.32.4-*.whl \
    .whl/mlx_lm-*.whl .whl/structlog-*.whl $(ls .whl/llguidance-*.whl 2>/dev/null || true)
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
bench="${GPU_BENCH:-gpu_bench}"
python3 "ops/gpu/$bench.py" --json "${OUT:-/tmp}/$bench.json" "$@" 2>&1 | tee "${OUT:-/tmp}/$bench.log"
