"""Loading a vision-language model: mlx-vlm loads it, and its language model becomes an mlx-lm
model over the same weight arrays, with the vision parts attached (``engine.vision``).

Why an mlx-lm model: the engine's batch (mlx-lm's caches, the phased step, the prefill pass
that yields first-token logits, speculative verification) then runs the language model of a
vision model exactly as it runs a text model's. The weights are shared, not copied.

Which models: those whose language model is a plain decoder with 1-D positions and whose image
features replace the image tokens' embeddings (``BATCHED_TYPES``). Models with M-RoPE (Qwen2-VL
and its kin) or with bidirectional attention over the image (PaliGemma, Gemma 3) are refused
with one line: mlx-lm's batch caches carry one position per token and causal masks only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_redis_protocol.install import install_command
from mlx_redis_protocol.logs import one_line

# mlx-vlm model types whose language model and image merge fit the engine's batch.
BATCHED_TYPES = ("smolvlm", "idefics3")


class VisionModelError(Exception):
    """A vision-language model this worker cannot serve (one line for the operator)."""


def is_vision_config(config: dict[str, Any]) -> bool:
    """A config of a vision-language model (Hugging Face's convention: a vision tower's
    config beside the text model's)."""
    return isinstance(config.get("vision_config"), dict)


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # mlx-lm's own load reports what is wrong with it
    return config if isinstance(config, dict) else {}


def vision_extra_hint() -> str:
    """How to install the vision extra (from the checkout the worker came from)."""
    return install_command("mlx-redis-worker", "vision")


def load_vision_model(folder: Path, config: dict[str, Any]) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the vision-language model in ``folder``: the mlx-lm language
    model with ``.vision`` set, and mlx-lm's tokenizer wrapper. ``VisionModelError`` when the
    vision extra is missing or the model type is not one the engine batches."""
    model_type = str(config.get("model_type", "")).lower()
    try:
        import mlx_vlm.utils as vlm_utils
        from mlx_lm.utils import load_tokenizer
    except ImportError as exc:
        raise VisionModelError(
            f"{model_type or 'this'} is a vision-language model and the vision extra is not "
            f"installed: {vision_extra_hint()}"
        ) from exc
    if model_type not in BATCHED_TYPES:
        raise VisionModelError(
            f"vision-language model type {model_type!r} is not one this engine batches "
            f"({', '.join(BATCHED_TYPES)}: a 1-D RoPE decoder whose image features replace "
            "the image tokens)"
        )
    from mlx_redis_worker.engine.vision import VisionModel

    try:
        vlm, processor = vlm_utils.load(str(folder))
    except Exception as exc:  # whatever mlx-vlm refuses: missing files, bad weights
        raise VisionModelError(
            f"mlx-vlm cannot load {folder}: {one_line(exc, typed=True)}"
        ) from exc
    model = language_model_of(vlm, config)
    image_token_id = int(vlm.config.image_token_index)
    model.vision = VisionModel(
        vlm=vlm,
        processor=processor,
        model_type=model_type,
        image_placeholder=str(processor.image_token),
        image_token_id=image_token_id,
    )
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else eos
    tokenizer = load_tokenizer(folder, eos_token_ids=eos_ids)
    return model, tokenizer


def language_model_of(vlm: Any, config: dict[str, Any]) -> Any:
    """mlx-lm's model of ``config``'s text model, over the arrays of ``vlm.language_model``
    (quantized where they are). mlx-vlm names the text model's body without mlx-lm's
    ``model.`` prefix in some architectures (Idefics3's): both spellings are matched, and any
    parameter left unmatched or of another shape refuses the model."""
    from mlx_lm.utils import _get_classes

    source = dict(tree_flatten(vlm.language_model.parameters()))
    text_config = dict(config["text_config"])
    text_config["tie_word_embeddings"] = "lm_head.weight" not in source
    text_config.setdefault("vocab_size", config.get("vocab_size"))
    model_class, args_class = _get_classes(text_config)
    model = model_class(args_class.from_dict(text_config))

    def source_name(name: str) -> str | None:
        for candidate in (name, name.removeprefix("model.")):
            if candidate in source:
                return candidate
        return None

    quantized = {
        path: source_name(f"{path}.scales")
        for path, module in model.named_modules()
        if hasattr(module, "to_quantized")
    }
    quantized = {path: name for path, name in quantized.items() if name is not None}
    if quantized:
        quantization = config.get("quantization") or {}
        nn.quantize(
            model,
            group_size=int(quantization.get("group_size", 64)),
            bits=int(quantization.get("bits", 4)),
            mode=str(quantization.get("mode", "affine")),
            class_predicate=lambda path, _module: path in quantized,
        )
    weights = []
    for name, wanted in tree_flatten(model.parameters()):
        found = source_name(name)
        if found is None or source[found].shape != wanted.shape:
            raise VisionModelError(
                f"the text model of this {config.get('model_type')} does not map onto mlx-lm's "
                f"{text_config.get('model_type')}: no weight of shape {wanted.shape} for {name}"
            )
        weights.append((name, source[found]))
    model.load_weights(weights, strict=True)
    model.eval()
    return model
