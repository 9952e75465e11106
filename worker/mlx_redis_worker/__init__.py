"""mlx-redis-worker: Redis stream jobs served by a continuous-batching MLX engine.

Importing this package loads OpenBLAS first on Linux (see ``mlx_redis_worker.blas``), so every
module below gets fast float32 matmuls from MLX's CPU backend.
"""

from mlx_redis_worker.blas import ensure_openblas

ensure_openblas()
