"""Loading an embedding model (through ``mlx_embeddings.load``) as the engine runs it.

A model folder in sentence-transformers' layout (it has ``modules.json``) is an embedding
model; mlx-embeddings (the worker's ``embeddings`` extra) loads it and pools as its
architecture does. What the engine needs beside the model is read from the folder: the vector
length (``1_Pooling/config.json``, else the model's hidden size), the longest input
(``sentence_bert_config.json``'s ``max_seq_length``, else the model's positions), the
special tokens the tokenizer puts around a text, and the Matryoshka lengths the folder
documents (``matryoshka_dimensions`` in ``config_sentence_transformers.json``: the lengths
its vectors were trained to be cut to; none, and only the full length is given).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mlx_redis_protocol.install import install_command
from mlx_redis_protocol.logs import one_line
from mlx_redis_worker.engine.embedding_model import EmbeddingModel
from mlx_redis_worker.models.loading import ModelUnavailable, locate_model

SENTENCE_TRANSFORMERS_MODULES = "modules.json"
MATRYOSHKA_KEY = "matryoshka_dimensions"
# What mlx-embeddings pools these architectures with: mean over the tokens (BERT, XLM-R).
MEAN_POOLED = ("bert", "xlm-roberta", "xlm_roberta")


def is_embedding_model(name_or_path: str) -> bool:
    """Whether the model is an embedding model (a sentence-transformers folder)."""
    return (locate_model(name_or_path) / SENTENCE_TRANSFORMERS_MODULES).is_file()


def load_embedding_model(name_or_path: str) -> EmbeddingModel:
    """The embedding model of a fixture name, folder or cached hub id; ``ModelUnavailable``
    (one line) when mlx-embeddings is missing or cannot load it."""
    folder = locate_model(name_or_path)
    try:
        from mlx_embeddings import load
    except ImportError as exc:
        raise ModelUnavailable(
            f"model {name_or_path!r} is an embedding model, and mlx-embeddings is not "
            f"installed: {install_command('mlx-redis-worker', 'embeddings')}"
        ) from exc
    config = _json(folder / "config.json")
    _check_pooling(name_or_path, folder, config)
    # The tokenizer's own threads (Rust's rayon, on by default) spin for work beside the
    # engine thread's forward pass and the other requests' tokenizing: on the 2-core dev
    # machine they cost the embedding engine 7% of its CPU per input (tiny-embed, 64 requests
    # in flight), and the library's own batches of 64 4%. An operator's setting is kept.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        model, tokenizer = load(str(folder))
    except Exception as exc:
        raise ModelUnavailable(
            f"model {name_or_path!r}: mlx-embeddings cannot load {folder}: "
            f"{one_line(exc, typed=True)}"
        ) from exc
    prefix, suffix = special_tokens_around(tokenizer)
    pooling = _json(folder / "1_Pooling" / "config.json")
    settings = _json(folder / "config_sentence_transformers.json")
    dimensions = int(pooling.get("word_embedding_dimension") or config["hidden_size"])
    matryoshka = tuple(
        sorted({int(d) for d in settings.get(MATRYOSHKA_KEY) or () if 0 < int(d) < dimensions})
    )
    return EmbeddingModel(
        model=model,
        tokenizer=tokenizer,
        name=name_or_path,
        dimensions=dimensions,
        max_input_tokens=_max_input_tokens(folder, config),
        vocab_size=int(config.get("vocab_size") or len(tokenizer.get_vocab())),
        pad_token_id=_pad_token_id(tokenizer, config),
        special_prefix=prefix,
        special_suffix=suffix,
        matryoshka_dimensions=matryoshka,
    )


def special_tokens_around(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special tokens the tokenizer puts before and after one text: where a probe's own
    tokens sit inside its tokens with specials."""
    probe = "hello world"
    whole = list(tokenizer(probe)["input_ids"])
    body = list(tokenizer.encode(probe, add_special_tokens=False))
    for start in range(len(whole) - len(body) + 1):
        if whole[start : start + len(body)] == body:
            return tuple(whole[:start]), tuple(whole[start + len(body) :])
    raise ModelUnavailable("the tokenizer's special tokens around a text could not be found")


def _max_input_tokens(folder: Path, config: dict[str, Any]) -> int:
    positions = int(config.get("max_position_embeddings") or 512)
    sequence = _json(folder / "sentence_bert_config.json").get("max_seq_length")
    return min(positions, int(sequence)) if sequence else positions


def _pad_token_id(tokenizer: Any, config: dict[str, Any]) -> int:
    for value in (getattr(tokenizer, "pad_token_id", None), config.get("pad_token_id")):
        if isinstance(value, int) and value >= 0:
            return value
    return 0


def _check_pooling(name: str, folder: Path, config: dict[str, Any]) -> None:
    """Refuse a folder whose pooling is not what mlx-embeddings does for its architecture
    (a CLS-pooled BERT would get mean-pooled vectors, silently unlike the model's own)."""
    pooling = _json(folder / "1_Pooling" / "config.json")
    if (
        config.get("model_type") in MEAN_POOLED
        and pooling
        and not pooling.get("pooling_mode_mean_tokens")
    ):
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_") and v)
        raise ModelUnavailable(
            f"model {name!r} pools with {', '.join(modes) or 'nothing'}, and mlx-embeddings "
            f"pools {config.get('model_type')} models by their mean: its vectors would differ"
        )


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}
