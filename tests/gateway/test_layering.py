"""The gateway is a protocol client: starting one loads no MLX (a second, and a GPU context
on a Mac) and nothing of the engine."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_imports_neither_mlx_nor_the_engine() -> None:
    probe = (
        "import sys, mlx_redis_gateway.app, mlx_redis_gateway.cli;"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')"
        " or m.split('.')[0] == 'mlx_redis_worker'];"
        "print(loaded)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
