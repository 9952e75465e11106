"""Random-weight llama / qwen3 models for fast, offline engine tests.

Sizes: ``micro`` ≈ 0.6M parameters (host-bound serving, for benchmarks), ``small`` ≈ 27M
(vocab 4096), ``medium`` ≈ 197M (vocab 8192); float32, tied
embeddings. Weights are drawn from N(0, 0.02) (norms are ones) with one PRNG key per parameter
split from a fixed seed, so two builds are bit-identical. The tokenizer is trained locally
(:mod:`mlx_redis_worker.models.tiny_tokenizer`) and carries a ChatML chat template.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3
from tqdm import tqdm

from mlx_redis_worker.models.folder import atomic_folder, is_prepared, write_json
from mlx_redis_worker.models.paths import ARCHS, SIZES, Arch, Size, tiny_dir
from mlx_redis_worker.models.tiny_tokenizer import SPECIAL_TOKENS, TINY_SPECIALS, train_tokenizer
from mlx_redis_worker.models.tokenizer_files import CHATML_TEMPLATE, save_tokenizer

SEED = 20240601
INIT_STD = 0.02
MAX_POSITIONS = 8192


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int


SHAPES: dict[str, Shape] = {
    "micro": Shape(hidden=64, layers=1, intermediate=128, heads=2, kv_heads=1, vocab=4096),
    "small": Shape(hidden=512, layers=8, intermediate=1536, heads=8, kv_heads=4, vocab=4096),
    "medium": Shape(hidden=1024, layers=16, intermediate=2816, heads=16, kv_heads=8, vocab=8192),
}


def tiny_config(arch: Arch, size: Size | Shape) -> dict[str, Any]:
    """The ``config.json`` of a tiny model (of a size, or of any shape)."""
    shape = size if isinstance(size, Shape) else SHAPES[size]
    eos_ids = [SPECIAL_TOKENS.index(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
        "model_type": arch,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": shape.vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_ids,
        "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
    }
    return config


def _model(config: dict[str, Any]) -> Any:
    module = llama if config["model_type"] == "llama" else qwen3
    return module.Model(module.ModelArgs.from_dict(config))


def random_weights(config: dict[str, Any], seed: int = SEED) -> dict[str, mx.array]:
    """Deterministic float32 weights for every parameter of the model ``config`` describes."""
    return random_parameters(_model(config), seed, desc=f"init {config['model_type']}")


def random_parameters(model: nn.Module, seed: int, desc: str) -> dict[str, mx.array]:
    """Weights for every parameter of ``model``, by name: N(0, ``INIT_STD``) with one PRNG key
    per parameter (split from ``seed`` in name order), except normalization layers, whose
    scales are ones and offsets zeros (a near-zero scale would silence what they feed)."""
    shapes = {name: p.shape for name, p in tree_flatten(model.parameters())}
    names = sorted(shapes)
    norms = {
        path
        for path, module in model.named_modules()
        if isinstance(module, nn.RMSNorm | nn.LayerNorm)
    }
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(tqdm(names, desc=desc, unit="tensor")):
        shape = shapes[name]
        owner, _, kind = name.rpartition(".")
        if owner in norms or name.endswith("norm.weight"):
            fill = mx.ones if kind == "weight" else mx.zeros
            weights[name] = fill(shape, dtype=mx.float32)
        else:
            weights[name] = INIT_STD * mx.random.normal(shape, dtype=mx.float32, key=keys[i])
        mx.eval(weights[name])
    return weights


def parameter_count(weights: dict[str, mx.array]) -> int:
    return sum(int(w.size) for w in weights.values())


def prepare_tiny(
    arch: Arch = "llama",
    size: Size = "small",
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """Build (or reuse) the random-weight ``arch`` model of ``size``; return its folder."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    dest = tiny_dir(arch, size, cache_dir)
    if is_prepared(dest) and not force:
        return dest

    config = tiny_config(arch, size)
    steps = tqdm(total=3, desc=f"tiny-{arch}-{size}", unit="step")
    tokenizer = train_tokenizer(config["vocab_size"], seed=SEED)
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    steps.update()
    weights = random_weights(config)
    steps.update()
    with atomic_folder(dest) as staging:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        save_tokenizer(
            tokenizer,
            staging,
            TINY_SPECIALS,
            chat_template=CHATML_TEMPLATE,
            model_max_length=MAX_POSITIONS,
        )
        generation = {k: config[k] for k in ("eos_token_id", "pad_token_id")}
        write_json(staging / "generation_config.json", generation)
        write_json(staging / "config.json", config)
    steps.update()
    steps.close()
    return dest
