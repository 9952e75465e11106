"""Where offline model fixtures live, and how short fixture names map to folders.

The cache root is ``$MLXW_MODEL_CACHE`` when set, else ``~/.cache/mlx-redis-worker/models``.
Short names (``tiny``, ``tiny-qwen3``, ``tiny-medium``, ``tiny-micro``, ``tiny-vision``,
``smollm2``, ``smollm2-draft``, and the embedding models ``tiny-embed`` and ``minilm``) resolve to
prepared folders there, preparing them on first use; anything else (a local path, a hub id)
passes through unchanged so ``mlx_lm.load`` keeps its usual meaning.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from mlx_redis_worker.models.folder import is_prepared

Dtype = Literal["float32", "bfloat16", "q4"]
Arch = Literal["llama", "qwen3"]
Size = Literal["micro", "small", "medium"]

CACHE_ENV = "MLXW_MODEL_CACHE"
DTYPES: tuple[Dtype, ...] = ("float32", "bfloat16", "q4")
ARCHS: tuple[Arch, ...] = ("llama", "qwen3")
SIZES: tuple[Size, ...] = ("micro", "small", "medium")


def default_cache_dir() -> Path:
    """The folder that holds every prepared fixture (not created here)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "mlx-redis-worker" / "models"


def _root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def smollm2_dir(dtype: Dtype = "float32", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder of SmolLM2-135M-Instruct converted to ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return _root(cache_dir) / f"smollm2-135m-instruct-{dtype}"


def tiny_dir(
    arch: Arch = "llama", size: Size = "small", cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The folder of the random-weight ``arch`` model of ``size``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    return _root(cache_dir) / f"tiny-{arch}-{size}"


def tiny_vision_dir(
    size: str = "small",
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: str = "float32",
) -> Path:
    """The folder of the random-weight SmolVLM of ``size`` (models/tiny_vision.py)."""
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return _root(cache_dir) / f"tiny-smolvlm-{size}{suffix}"


def _prepare_tiny_vision() -> Path:
    from mlx_redis_worker.models.tiny_vision import prepare_tiny_vision

    return prepare_tiny_vision("small")


EncoderName = Literal["tiny-embed", "minilm"]
ENCODER_FOLDERS: dict[str, str] = {"tiny-embed": "tiny-bert-embed", "minilm": "all-minilm-l6-v2"}


def encoder_dir(name: EncoderName, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder of the embedding-model fixture ``name``."""
    return _root(cache_dir) / ENCODER_FOLDERS[name]


def _prepare_encoder(name: EncoderName) -> Callable[[], Path]:
    def prepare() -> Path:
        from mlx_redis_worker.models.encoders import prepare_minilm, prepare_tiny_encoder

        return prepare_tiny_encoder() if name == "tiny-embed" else prepare_minilm()

    return prepare


def _prepare_tiny(arch: Arch, size: Size) -> Callable[[], Path]:
    def prepare() -> Path:
        from mlx_redis_worker.models.tiny import prepare_tiny

        return prepare_tiny(arch=arch, size=size)

    return prepare


def _prepare_smollm2(dtype: Dtype) -> Callable[[], Path]:
    def prepare() -> Path:
        from mlx_redis_worker.models.smollm2 import prepare_smollm2

        return prepare_smollm2(dtype=dtype)

    return prepare


def _smollm2_draft_dir() -> Path:
    from mlx_redis_worker.models.draft import SMOLLM2_DRAFT_LAYERS, truncated_dir

    return truncated_dir(smollm2_dir("float32"), SMOLLM2_DRAFT_LAYERS)


def _prepare_smollm2_draft() -> Path:
    from mlx_redis_worker.models.draft import prepare_smollm2_draft

    return prepare_smollm2_draft()


# Short name -> (folder in the default cache, how to build it when missing).
FIXTURES: dict[str, tuple[Callable[[], Path], Callable[[], Path]]] = {
    "tiny": (lambda: tiny_dir("llama", "small"), _prepare_tiny("llama", "small")),
    "tiny-qwen3": (lambda: tiny_dir("qwen3", "small"), _prepare_tiny("qwen3", "small")),
    "tiny-medium": (lambda: tiny_dir("llama", "medium"), _prepare_tiny("llama", "medium")),
    # Compute so small that serving is host-bound, as on a fast GPU: benchmarks use it to show
    # the engine's own per-token host work.
    "tiny-micro": (lambda: tiny_dir("llama", "micro"), _prepare_tiny("llama", "micro")),
    # A vision-language model (SmolVLM's architecture; needs the vision extra, mlx-vlm).
    "tiny-vision": (tiny_vision_dir, _prepare_tiny_vision),
    "smollm2": (lambda: smollm2_dir("float32"), _prepare_smollm2("float32")),
    # SmolLM2's first layers as its draft model (models/draft.py).
    "smollm2-draft": (_smollm2_draft_dir, _prepare_smollm2_draft),
    # Embedding models (models/encoders.py): a random-weight BERT, and all-MiniLM-L6-v2.
    "tiny-embed": (lambda: encoder_dir("tiny-embed"), _prepare_encoder("tiny-embed")),
    "minilm": (lambda: encoder_dir("minilm"), _prepare_encoder("minilm")),
}


def resolve_model(name_or_path: str) -> str:
    """Map a fixture name to its prepared folder (preparing it if needed); else pass through."""
    fixture = FIXTURES.get(name_or_path)
    if fixture is None:
        return name_or_path
    folder_of, prepare = fixture
    folder = folder_of()
    if not is_prepared(folder):
        folder = prepare()
    return str(folder)
