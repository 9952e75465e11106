"""A random-weight SmolVLM (mlx-vlm's ``smolvlm``: SigLIP tower, pixel-shuffle connector, a
Llama text model) with a locally trained tokenizer and a local processor, for offline tests.

Why SmolVLM: its text model is a plain 1-D RoPE decoder, so an image request's prompt is
prefilled in the engine's batch exactly like a text prompt once its image positions hold the
vision features; Qwen2-VL's M-RoPE would need per-position 3-D positions through mlx-lm's batch
caches, which they do not carry.

Sizes: ``small`` (tests and the CPU bench: 32-pixel tiles of 8-pixel patches, 4 image tokens
a tile, images split into up to 2 x 2 tiles plus the whole one; a 4-layer text model of width
256) and ``2b`` (SmolVLM2-2.2B's shape, for the GPU bench: SigLIP-so400m at 384 pixels, scale
factor 3, SmolLM2-1.7B's text model). Weights are drawn as for ``tiny``: one PRNG key per
parameter from a fixed seed, so builds are bit-identical.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer

from mlx_redis_worker.models.folder import atomic_folder, is_prepared, write_json
from mlx_redis_worker.models.paths import tiny_vision_dir
from mlx_redis_worker.models.tiny import SEED, Shape, random_parameters, tiny_config
from mlx_redis_worker.models.tiny_tokenizer import IM_END, SPECIAL_TOKENS, train_tokenizer
from mlx_redis_worker.models.tokenizer_files import SpecialTokens, save_tokenizer

VisionSize = Literal["small", "2b"]
VISION_SIZES: tuple[VisionSize, ...] = ("small", "2b")
VisionDtype = Literal["float32", "bfloat16"]

IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
MAX_TILES_PER_SIDE = 4  # the processor names each tile <row_R_col_C>; more are never made
TILE_TOKENS = tuple(
    f"<row_{r}_col_{c}>"
    for r in range(1, MAX_TILES_PER_SIDE + 1)
    for c in range(1, MAX_TILES_PER_SIDE + 1)
)
VISION_SPECIALS = (IMAGE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, *TILE_TOKENS)
# What the text model's config keeps of ``tiny``'s (the rest is the vision model's).
TEXT_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
)

# ChatML, where a message's content may be a list of parts: {"type": "text", "text": ...} or
# {"type": "image"} (rendered as the image placeholder the processor expands).
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class VisionShape:
    text: Shape  # the Llama text model, as ``tiny``'s (its vocab: the trained tokenizer's)
    # Vision tower (SigLIP) and connector.
    vision_hidden: int
    vision_layers: int
    vision_intermediate: int
    vision_heads: int
    patch: int
    tile: int  # pixels of one tile's side (the tower's image_size)
    scale_factor: int
    longest_edge: int  # images are resized to at most this, then split into tiles
    model_vocab: int | None = None  # the model's vocabulary when padded past the tokenizer's

    @property
    def image_seq_len(self) -> int:
        """Image tokens per tile: patches per tile over the connector's pixel shuffle."""
        return (self.tile // self.patch) ** 2 // self.scale_factor**2


VISION_SHAPES: dict[VisionSize, VisionShape] = {
    "small": VisionShape(
        Shape(hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2, vocab=4096),
        vision_hidden=64,
        vision_layers=2,
        vision_intermediate=256,
        vision_heads=2,
        patch=8,
        tile=32,
        scale_factor=2,
        longest_edge=64,
    ),
    "2b": VisionShape(
        Shape(hidden=2048, layers=24, intermediate=8192, heads=32, kv_heads=32, vocab=8192),
        vision_hidden=1152,
        vision_layers=27,
        vision_intermediate=4304,
        vision_heads=16,
        patch=14,
        tile=384,
        scale_factor=3,
        longest_edge=1536,
        model_vocab=49280,
    ),
}


def vision_config(size: VisionSize, tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``config.json`` of the tiny SmolVLM of ``size`` over ``tokenizer``'s ids: its text
    model is ``tiny``'s Llama config of that shape, untied (SmolVLM has its own head)."""
    shape = VISION_SHAPES[size]
    vocab = shape.model_vocab or tokenizer.get_vocab_size()
    decoder = tiny_config("llama", shape.text)
    text = {key: decoder[key] for key in TEXT_KEYS} | {
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "smolvlm_vision",
        "hidden_size": shape.vision_hidden,
        "num_hidden_layers": shape.vision_layers,
        "intermediate_size": shape.vision_intermediate,
        "num_attention_heads": shape.vision_heads,
        "patch_size": shape.patch,
        "image_size": shape.tile,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }
    return {
        "architectures": ["SmolVLMForConditionalGeneration"],
        "model_type": "smolvlm",
        "image_token_id": tokenizer.token_to_id(IMAGE_TOKEN),
        "scale_factor": shape.scale_factor,
        "vocab_size": vocab,
        "eos_token_id": decoder["eos_token_id"],
        "pad_token_id": decoder["pad_token_id"],
        "text_config": text,
        "vision_config": vision,
        "torch_dtype": "float32",
    }


def processor_files(size: VisionSize) -> dict[str, dict[str, Any]]:
    """``preprocessor_config.json`` and ``processor_config.json``: transformers' SmolVLM image
    processor (resize, split into tiles, rescale, normalize) and the processor's image tokens
    per tile."""
    shape = VISION_SHAPES[size]
    image_processor = {
        "image_processor_type": "SmolVLMImageProcessor",
        "processor_class": "SmolVLMProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": shape.longest_edge},
        "resample": 1,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": shape.tile},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    processor = {"processor_class": "SmolVLMProcessor", "image_seq_len": shape.image_seq_len}
    return {"preprocessor_config.json": image_processor, "processor_config.json": processor}


def vision_tokenizer(size: VisionSize) -> Tokenizer:
    """The tiny models' trained BPE with the SmolVLM image tokens added after it."""
    tokenizer = train_tokenizer(VISION_SHAPES[size].text.vocab, seed=SEED)
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in VISION_SPECIALS])
    return tokenizer


def random_vision_weights(config: dict[str, Any], seed: int = SEED) -> dict[str, mx.array]:
    """Deterministic float32 weights for every parameter of mlx-vlm's model of ``config``."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config = update_module_configs(model_config, module, config, ["text", "vision"])
    return random_parameters(module.Model(model_config), seed, desc="init smolvlm")


def silence_padded_vocab(weights: dict[str, mx.array], used: int) -> dict[str, mx.array]:
    """The head's rows past the tokenizer's ``used`` ids set to zero: a real model pads its
    vocabulary with rows that never win, and a random one's would make ids no tokenizer
    decodes (mlx-vlm's detokenizer fails on them). The maximum of thousands of random logits
    is above zero, so greedy decoding never picks a padded id."""
    return {
        name: mx.concatenate([weight[:used], mx.zeros_like(weight[used:])])
        if name.endswith("lm_head.weight") and weight.shape[0] > used
        else weight
        for name, weight in weights.items()
    }


def prepare_tiny_vision(
    size: VisionSize = "small",
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    dtype: VisionDtype = "float32",
) -> Path:
    """Build (or reuse) the random-weight SmolVLM of ``size`` in ``dtype`` (the weights are
    drawn in float32, then cast); return its folder. Needs the vision extra (mlx-vlm) for the
    model's parameter shapes."""
    if size not in VISION_SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {VISION_SIZES}")
    dest = tiny_vision_dir(size, cache_dir, dtype)
    if is_prepared(dest) and not force:
        return dest
    tokenizer = vision_tokenizer(size)
    config = vision_config(size, tokenizer)
    config["torch_dtype"] = dtype
    weights = silence_padded_vocab(random_vision_weights(config), tokenizer.get_vocab_size())
    if dtype == "bfloat16":
        weights = {name: weight.astype(mx.bfloat16) for name, weight in weights.items()}
    with atomic_folder(dest) as staging:
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
        special = SpecialTokens(
            eos=IM_END, pad="<|endoftext|>", extra=(*SPECIAL_TOKENS, *VISION_SPECIALS)
        )
        save_tokenizer(
            tokenizer,
            staging,
            special,
            chat_template=VISION_CHAT_TEMPLATE,
            model_max_length=config["text_config"]["max_position_embeddings"],
        )
        for name, content in processor_files(size).items():
            write_json(staging / name, content)
        write_json(staging / "chat_template.json", {"chat_template": VISION_CHAT_TEMPLATE})
        generation = {k: config[k] for k in ("eos_token_id", "pad_token_id")}
        write_json(staging / "generation_config.json", generation)
        write_json(staging / "config.json", config)
    return dest
