"""Whether a worker's models fit in memory, checked before any of them loads.

Each model a worker serves is loaded once, into its own engine: its weights are not shared with
the worker's other models, and its KV caches and prefix cache are its own. What the engines do
share is the process and MLX's allocator (one buffer cache, one memory limit). So the weights
of all the models must fit together, with room to spare for their caches: a set that does not
fit is refused with one line before minutes are spent loading it, instead of swapping or being
killed for memory once the last model loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mlx_redis_worker.daemon.settings import ServedModel
from mlx_redis_worker.models.loading import ModelUnavailable, locate_model

# Room beyond the weights for activations, KV caches and the allocator's buffer cache.
HEADROOM = 1.10
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz")
MIB = 1024 * 1024


class ModelsDoNotFit(ModelUnavailable):
    """The models' weights need more memory than the worker may use (one line)."""


def check_fit(models: Sequence[ServedModel], *, limit_mb: int | None) -> None:
    """Refuse (``ModelsDoNotFit``) models whose weights, plus headroom, exceed ``limit_mb``
    (default: the memory available on this machine)."""
    sizes = {m.name: weights_bytes(locate_model(m.source)) for m in models}
    need = int(sum(sizes.values()) * HEADROOM)
    budget, where = (
        (limit_mb * MIB, "memory_limit_mb") if limit_mb is not None else available_memory()
    )
    if need > budget:
        each = ", ".join(f"{name} {size / MIB:,.0f} MiB" for name, size in sizes.items())
        raise ModelsDoNotFit(
            f"the models do not fit: their weights ({each}) plus {HEADROOM - 1:.0%} need "
            f"{need / MIB:,.0f} MiB, and {budget / MIB:,.0f} MiB is available ({where}); "
            "serve fewer models per worker, or raise memory_limit_mb"
        )


def weights_bytes(folder: Path) -> int:
    """The size of a model folder's weight files (links followed: a hub cache's are)."""
    return sum(
        path.stat().st_size
        for path in folder.iterdir()
        if path.name.endswith(WEIGHT_SUFFIXES) and path.is_file()
    )


def available_memory() -> tuple[int, str]:
    """Bytes this process may still fill, and where the figure comes from: Linux's
    MemAvailable (free plus reclaimable page cache), else the machine's physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"
