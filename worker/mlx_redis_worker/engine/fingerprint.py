"""A short, stable identity for a loaded model, so a saved prompt cache is never applied to the
wrong weights. Hashes the parameter names, shapes, dtypes and a few values of each tensor, plus
the tokenizer's vocabulary size: two models of one architecture but different weights differ.
A vision-language model's vision tower and connector count too (an image's cached KV state
depends on them).
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_redis_worker.engine.vision import vision_model_of


def model_fingerprint(model: Any, tokenizer: Any) -> str:
    digest = hashlib.sha256()
    digest.update(type(model).__module__.encode())
    parameters = tree_flatten(model.parameters())
    vision = vision_model_of(model)
    if vision is not None:
        parameters += [(f"vision.{n}", v) for n, v in tree_flatten(vision.vlm.parameters())]
    for name, value in sorted(parameters, key=lambda item: item[0]):
        sample = value.reshape(-1)[:4].astype(mx.float32).tolist()
        digest.update(f"{name}|{value.shape}|{value.dtype}|{sample}".encode())
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer.get_vocab())
    digest.update(str(vocab).encode())
    return digest.hexdigest()[:16]
