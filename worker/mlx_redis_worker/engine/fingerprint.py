"""A short, stable identity for a loaded model, so a saved prompt cache is never applied to the
wrong weights. Hashes the parameter names, shapes, dtypes and a few values of each tensor, plus
the tokenizer's vocabulary size: two models of one architecture but different weights differ.
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten


def model_fingerprint(model: Any, tokenizer: Any) -> str:
    digest = hashlib.sha256()
    digest.update(type(model).__module__.encode())
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        sample = value.reshape(-1)[:4].astype(mx.float32).tolist()
        digest.update(f"{name}|{value.shape}|{value.dtype}|{sample}".encode())
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer.get_vocab())
    digest.update(str(vocab).encode())
    return digest.hexdigest()[:16]
