"""Layer-truncated draft models: the first N decoder layers of a model, same embeddings, final
norm and head, same tokenizer (a "self-speculative" / LayerSkip draft).

Nothing smaller than SmolLM2-135M with its tokenizer can be had offline, so its draft is a
truncated copy of itself (``smollm2-draft``). Its drafts are what the full model's first N
layers already say about the next token; the verify pass of the whole model decides.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import mlx.core as mx

from mlx_redis_worker.models.folder import atomic_folder, is_prepared, write_json

# Files a model folder has besides its weights and config: the tokenizer's, copied as they are.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncated_dir(source: Path, layers: int) -> Path:
    """Where the first ``layers`` layers of ``source`` are kept: beside it."""
    return source.parent / f"{source.name}-first{layers}"


def prepare_truncated(
    source: Path,
    layers: int,
    dest: Path | None = None,
    force: bool = False,
) -> Path:
    """Build (or reuse) the folder of ``source``'s first ``layers`` decoder layers; return it.

    ``source`` must be an mlx-lm folder with one ``model.safetensors`` and a Llama-style
    ``config.json`` (``num_hidden_layers``, weights under ``model.layers.{i}.``).
    """
    dest = dest if dest is not None else truncated_dir(source, layers)
    if is_prepared(dest) and not force:
        return dest
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    total = int(config["num_hidden_layers"])
    if not 1 <= layers < total:
        raise ValueError(
            f"a truncated draft keeps 1 to {total - 1} of {total} layers, not {layers}"
        )
    weights = mx.load(str(source / "model.safetensors"))
    assert isinstance(weights, dict)
    kept = {
        name: array
        for name, array in weights.items()
        if (match := _LAYER.match(name)) is None or int(match.group(1)) < layers
    }
    config["num_hidden_layers"] = layers
    with atomic_folder(dest) as staging:
        mx.save_safetensors(str(staging / "model.safetensors"), kept, metadata={"format": "mlx"})
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, staging / name)
        write_json(staging / "config.json", config)
    return dest


# Layers of SmolLM2-135M's 30 that ``smollm2-draft`` keeps (measured: docs/speculative-decoding.md).
SMOLLM2_DRAFT_LAYERS = 24


def prepare_smollm2_draft(
    layers: int = SMOLLM2_DRAFT_LAYERS,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """The first ``layers`` layers of the float32 SmolLM2 fixture (built first if needed)."""
    from mlx_redis_worker.models.smollm2 import prepare_smollm2

    return prepare_truncated(prepare_smollm2("float32", cache_dir), layers, force=force)
